"""Everything that answers a chat turn: the OpenAI-compatible client (``client``), the built-in
``echo`` model (``echo``), what the pipeline needs of either (``backend``) and the routing of a
turn to one of them (``routing``)."""
