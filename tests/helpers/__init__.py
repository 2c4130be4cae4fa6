"""Helpers the tests share: batch generators (`batches`), the independent float64 oracle
(`reference`), metric and alert names (`names`), what API tests send and read (`wire`), the app in
process (`inproc`), processes (`procs`), the Prometheus stack (`stack`) and the stand-in SGLang
(`fake_sglang`)."""
