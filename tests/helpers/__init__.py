"""Helpers the tests share: batch generators (`batches`), the independent float64 oracle
(`reference`), metric and alert names (`names`), processes (`procs`), the Prometheus stack
(`stack`) and the stand-in SGLang (`fake_sglang`)."""
