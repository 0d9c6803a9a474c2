"""Using a saved model: KV-cache sampling (``sampling``), ``domino generate`` and ``domino eval``
(``generate_cmd``, ``eval_cmd``) over a shared launcher (``session``)."""
