"""The OpenAI-compatible ``/v1`` routes, as vLLM's OpenAI server speaks them: the field table
(:mod:`.fields`), reading a request (:mod:`.requests`), the answer shapes with logprobs and echo
(:mod:`.answers`), server-sent events (:mod:`.streaming`) and the routes (:mod:`.routes`).
docs/openai.md is the user's page."""
