"""``flashgen bench``: flashgen next to PyTorch SDPA, FlexAttention and other peers, in one run.

- ``settings``: the suites, their axes and the full / ``--quick`` defaults (no torch);
- ``timing``: timers, measured ceilings, the GPU header;
- ``peers``: each implementation as a factory of calls, with the reason when it does not apply;
- ``suites``: the prefill, decode and compile suites (configs, output checks, timing);
- ``report``: the terminal table, JSON and plots.
"""
