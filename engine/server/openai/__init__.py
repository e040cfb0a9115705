"""The OpenAI-compatible ``/v1`` routes, as vLLM's OpenAI server speaks them: the field table
(:mod:`.fields`), reading a request (:mod:`.requests`), the answer shapes with logprobs and echo
(:mod:`.answers`), server-sent events cut from a finished answer (:mod:`.streaming`) or sent as the
tokens are drawn (:mod:`.live`), and the routes (:mod:`.routes`). docs/openai.md is the user's page."""
