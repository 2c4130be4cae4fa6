"""The one compiled extension of timwatch: the proxies' C reader (sidecar/proxy/native/_cstream.c).

Optional: without a C compiler or Python's headers the install still succeeds and the proxies
read with orjson instead (sidecar/proxy/native/__init__.py). Everything else about the package
is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "timwatch.sidecar.proxy.native._cstream",
            sources=["sidecar/proxy/native/_cstream.c"],
            depends=[
                f"sidecar/proxy/native/csrc/{h}.h"
                for h in ("common", "dechunk", "deltas", "jsonwalk", "numbers")
            ],
            extra_compile_args=["-O3", "-Wno-psabi"],
            optional=True,
        )
    ]
)
