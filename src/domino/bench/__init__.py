"""``domino bench``'s library: what a run measures (``spec``, ``modes``), running its ranks
(``execute``, ``worker``, ``pipeline``), the link and CPU probes (``probe``), what it attaches
to the collectives (``hooks``: a timeline tracer and a simulated link, through ``CommHook``),
and its figures and reports (``figures``, ``report``, ``pipeline_report``, ``timeline``,
``memory``)."""
