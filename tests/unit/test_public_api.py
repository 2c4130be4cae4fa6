"""The names users import, at each package root, and the one exception tree."""

from __future__ import annotations

import importlib
import inspect

import pytest

import timwatch
import timwatch.monitor
import timwatch.sidecar
import timwatch.sidecar.tap
from timwatch.monitor.core import errors

ROOT_API = {
    "ApiError", "Batch", "BatchError", "InputError", "InsecureBindError", "JoinError",
    "PolicyParams", "SeriesMismatch", "Settings", "StoreUnavailable", "Tap", "TimwatchClient",
    "TimwatchError", "TimwatchHTTPError", "WireError", "__version__", "accumulate", "analyze",
    "create_app", "estr_keep_mask", "estr_ppo_loss", "keep_masks",
}  # fmt: skip
MONITOR_API = {
    "POLICIES", "Accumulator", "ApiError", "Batch", "BatchError", "EwmaOldPolicy", "InputError",
    "InsecureBindError", "JoinError", "MetricRow", "PolicyParams", "SeriesMismatch", "Settings",
    "Store", "StoreUnavailable", "TimwatchClient", "TimwatchError", "TimwatchHTTPError",
    "WireError", "__version__", "accumulate", "analyze", "create_app", "decode_masks",
    "decoupled_ppo_loss", "decoupled_ratios", "delta_abs_keep_mask", "derive_row",
    "estr_keep_mask", "estr_ppo_loss", "geo_rs_keep_mask", "icepop_keep_mask",
    "k3_rs_keep_mask", "keep_masks", "kpop_keep_mask", "logprobs_and_entropy_from_logits",
    "seq_mis_keep_mask", "tis_keep_mask", "tis_weights",
}  # fmt: skip
SIDECAR_API = {
    "CaptureStore", "JoinedSample", "Joiner", "RolloutRecord", "Tap", "TapStats", "parse_report",
}  # fmt: skip


@pytest.mark.parametrize(
    ("package", "expected"),
    [
        (timwatch, ROOT_API),
        (timwatch.monitor, MONITOR_API),
        (timwatch.sidecar, SIDECAR_API),
        (timwatch.sidecar.tap, {"MarkerFile", "Page", "RunPaged", "Tap", "TapStats"}),
    ],
)
def test_exported_names(package: object, expected: set[str]) -> None:
    assert set(package.__all__) == expected  # type: ignore[attr-defined]
    assert set(package.__all__) <= set(dir(package))  # type: ignore[attr-defined]
    for name in expected:
        value = getattr(package, name)
        assert value is not None, name
        if not name.startswith("__") and hasattr(value, "__module__"):
            # re-exported from where it is defined, not a copy
            home = importlib.import_module(value.__module__)
            assert getattr(home, name) is value, name


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        timwatch.nope  # type: ignore[attr-defined]  # noqa: B018


def test_root_reexports_are_the_same_objects() -> None:
    assert timwatch.Batch is timwatch.monitor.Batch
    assert timwatch.Tap is timwatch.sidecar.Tap is timwatch.sidecar.tap.Tap
    assert timwatch.estr_keep_mask is timwatch.monitor.estr_keep_mask


def test_one_exception_tree() -> None:
    """Every exception class defined anywhere in the package derives from TimwatchError."""
    classes = [
        obj
        for name in errors.__all__
        if inspect.isclass(obj := getattr(errors, name)) and issubclass(obj, BaseException)
    ]
    assert all(issubclass(c, errors.TimwatchError) for c in classes)
    assert issubclass(errors.BatchError, ValueError)  # old handlers keep working
    assert issubclass(errors.StoreUnavailable, RuntimeError)


def test_no_exception_class_outside_the_tree() -> None:
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    found = []
    for folder in ("monitor", "sidecar", "dashboards", "timwatch"):
        for path in (root / folder).rglob("*.py"):
            if path.name == "errors.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and b.id in ("Exception", "ValueError", "RuntimeError")
                    for b in node.bases
                ):
                    found.append(f"{path.relative_to(root)}:{node.name}")
    assert found == []


def test_version_comes_from_the_metadata() -> None:
    from importlib.metadata import version

    assert timwatch.__version__ == version("timwatch") == timwatch.monitor.__version__
