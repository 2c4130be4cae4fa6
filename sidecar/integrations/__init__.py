"""Plug-ins for RL training frameworks (verl, slime, TRL, AReaL, OpenRLHF) and hooks into their
loggers (`loggers`).

Each framework plug-in imports torch (`loggers` does not) and is meant to be imported by the
trainer process only; none of them needs its framework installed to be imported. `verl` (the
entry module) also registers the loss and installs `verl_hooks` when verl is installed;
`verl_loss` holds the loss side. `areal` installs its hooks on AReaL's PPO actor module when
imported (TIMWATCH_AREAL_AUTOINSTALL=0 turns that off; then call `install()`);
`openrlhf.install()` hooks OpenRLHF's actor worker classes. Importing this package itself imports
nothing heavy.
"""

__all__: list[str] = []
