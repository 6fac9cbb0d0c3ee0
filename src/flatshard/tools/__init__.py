"""The tools built on the library: the ``flatshard`` command (``cli``), the trainer (``train``),
the estimator (``estimate``), ``bench`` and ``export``. The library never imports them."""
