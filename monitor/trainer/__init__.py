"""Trainer-side torch code: chunked log-probs and entropy, the ESTR PPO loss, decoupled ratios.
Needs the ``torch`` extra; the service never imports it."""
