"""``POST /v1/responses``, the OpenAI Responses API, with memory.

- :mod:`.request`: the request's gateway fields, the user's text memory recalls for, and the
  memory section placed in ``instructions``;
- :mod:`.translate`: a text turn to chat completions and back (JSON and the stream's events),
  for a backend that serves chat completions only;
- :mod:`.backends`: what each backend of a route is asked (the Responses API as is, or the
  translation), carried through the router so that routing and fallbacks are chat's;
- :mod:`.route`: the route itself.
"""
