"""Using a saved model: KV-cache sampling (``sampling``), loading and launching ranks
(``session``) and what a rank of ``domino generate`` / ``domino eval`` does (``tasks``)."""
