"""``narwhal-bench``: load generator, baselines (direct, bare proxy, round-robin), Narwhal open and
predictive, goodput report and plots.  ``narwhal-bench overhead --help`` / ``goodput --help``.

Modules: ``workload`` (arrivals, lengths, bodies), ``client`` (aiohttp load generator), ``stats``
(percentiles, goodput, Retry-After accuracy: definitions in its docstring), ``proxy`` (the bare
baseline), ``procs``/``fleet`` (child processes and targets), ``overhead``/``goodput`` (the modes),
``report``/``views`` (tables, JSON, plots), ``cli``.
"""
