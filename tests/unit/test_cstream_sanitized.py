"""The C reader built again with AddressSanitizer and UndefinedBehaviorSanitizer (both fatal),
in a subprocess fed random bytes and mutated streams: a read or write outside its buffers, or
undefined behaviour, fails the test; each answer is also checked against the orjson fallback
(the delta scan's frames, the log-prob lists, the walk's spans) and de-chunking against itself
cut elsewhere. The bytes it reads come from an engine over the network, so this is the build
that would show a missed bound, not just a wrong answer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_FUZZ = textwrap.dedent(
    """
    import importlib.util, random, sys
    import timwatch.sidecar.proxy.native as native
    name = "timwatch.sidecar.proxy.native._cstream"
    spec = importlib.util.spec_from_file_location(name, sys.argv[1])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[spec.name] = mod
    native._cstream = native._built = native._use = mod
    assert native.cstream() is mod
    import numpy as np, orjson
    from tests.helpers.readers import httptools_dechunk
    from tests.unit.test_cstream import _agrees_with_orjson, _c_dechunk
    from tests.unit.test_deltascan import _frame, _stream

    rng = random.Random(int(sys.argv[2]))
    alphabet = b'\\n"{}[],:0123456789.-eEnfio_tdarsl \\r'
    base = _stream(40)
    pow5 = native.POW5
    answer = orjson.dumps({"id": "x", "choices": [{"index": 0, "logprobs": {"content": [
        {"logprob": -1.5, "token": '\\"{', "bytes": [34, 123]}]}, "token_ids": [1, 2]}]})
    for _ in range(int(sys.argv[3])):
        kind = rng.random()
        if kind < 0.2:
            buf = bytes(rng.choice(alphabet) for _ in range(rng.randrange(600)))
        elif kind < 0.45:  # whole unfinished deltas: read to the buffer's last byte
            m = rng.randrange(1, 12)
            text = "a" * rng.randrange(64)
            buf = b"".join(_frame(i, m + 1, text, "-0.5", i) for i in range(1, m + 1))
        else:
            b = bytearray(base[rng.randrange(len(base)) :][: rng.randrange(1, len(base))])
            for _ in range(rng.randrange(8)):
                if b:
                    b[rng.randrange(len(b))] = rng.choice(alphabet)
            buf = bytes(b)
        _agrees_with_orjson(buf, rng.choice([4096, 300, 64, 8]))
        cut = rng.randrange(len(buf) + 1)
        reads = [buf[:cut], buf[cut:]]
        body, phase = _c_dechunk(reads)
        if phase == 10:  # done: llhttp reads the same body
            assert body == httptools_dechunk(reads)[0], reads
        assert (body, phase) == _c_dechunk([buf]), buf
        key = buf.find(b'"output_token_logprobs":')
        pos = key + 24 if key >= 0 and rng.random() < 0.7 else rng.randrange(len(buf) + 1)
        room = (len(buf) - pos) // 10 + 1
        ids, vals = np.empty(room, np.int64), np.empty(room, np.float64)
        count, end = mod.triples(buf, pos, ids, vals, pow5)
        if count > 0:
            got = [[v, int(t), None] for v, t in zip(vals[:count].tolist(), ids[:count].tolist())]
            assert orjson.loads(buf[pos:end]) == got, (buf, pos)
        doc = bytearray(answer)
        for _ in range(rng.randrange(4)):
            doc[rng.randrange(len(doc))] = rng.choice(alphabet + b"\\\\")
        rows = np.empty((rng.randrange(1, 40), 7), np.int64)
        r = mod.walk(bytes(doc), rng.randrange(1, 6), rng.randrange(1, 6), rows)
        assert -2 <= r <= rows.shape[0]
        for row in rows[1 : max(r, 0)].tolist():
            assert 0 <= row[4] < row[5] <= len(doc)
        at = doc.find(b"[{") if rng.random() < 0.7 else rng.randrange(len(doc) + 1)
        count, text = mod.member_values(bytes(doc), max(at, 0), b"logprob")
        if count >= 0:  # the values copied verbatim: JSON only where the bytes were
            assert text[:1] == b"[" and text[-1:] == b"]" and len(text) <= len(doc) + 2
    print("clean", sys.argv[3])
    """
)


def _runtime(gcc: str, name: str) -> str:
    path = subprocess.run([gcc, f"-print-file-name={name}"], capture_output=True, text=True)
    return path.stdout.strip()


def test_the_c_reader_reads_hostile_bytes_inside_its_buffers(tmp_path: Path) -> None:
    gcc = shutil.which("gcc")
    asan = _runtime(gcc, "libasan.so") if gcc else ""
    if not gcc or not os.path.isabs(asan):
        if os.environ.get("CI") or os.environ.get("TIMWATCH_NATIVE") == "1":
            pytest.fail("gcc with AddressSanitizer is needed for the sanitized C reader")
        pytest.skip("no gcc with AddressSanitizer here")
    built = tmp_path / f"_cstream{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(
        [
            gcc,
            "-O1",
            "-g",
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=undefined",
            "-fno-omit-frame-pointer",
            "-shared",
            "-fPIC",
            "-Wno-psabi",
            f"-I{sysconfig.get_paths()['include']}",
            str(ROOT / "sidecar/proxy/native/_cstream.c"),
            "-o",
            str(built),
        ],
        check=True,
    )
    env = dict(os.environ)
    env["LD_PRELOAD"] = f"{asan}:{_runtime(gcc, 'libubsan.so')}"
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1"
    env["PYTHONMALLOC"] = "malloc"  # every object in malloc, where ASan puts its red zones
    env["PYTHONPATH"] = str(ROOT)
    env.pop("TIMWATCH_NATIVE", None)
    run = subprocess.run(
        [sys.executable, "-c", _FUZZ, str(built), "11", "3000"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.strip().endswith("clean 3000"), run.stdout
    assert "runtime error" not in run.stderr and "AddressSanitizer" not in run.stderr
