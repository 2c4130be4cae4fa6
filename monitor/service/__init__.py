"""The HTTP service: `create_app(settings, *, store=None)` with its routers, the Prometheus
exporter, the live run registry, settings and the ``timwatch serve`` runner. Importing this
package imports nothing; FastAPI loads with `timwatch.monitor.service.app`."""
