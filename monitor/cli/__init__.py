"""The monitor's command-line commands (analyze, serve, history, dashboards push). The
``timwatch`` program itself is assembled in `timwatch.cli`, which also mounts the sidecar's."""
