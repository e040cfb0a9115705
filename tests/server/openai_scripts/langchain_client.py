"""Run under a venv holding only langchain-openai: ChatOpenAI's invoke, batch and stream and the
completions-style OpenAI class against the engine's /v1. Writes what it saw as JSON to spec["out"]."""

import json
import sys

from langchain_openai import ChatOpenAI, OpenAI

spec = json.loads(sys.argv[1])
base = {"model": spec["model"], "base_url": spec["base_url"], "api_key": spec["key"], "max_retries": 0}
seen = {}
short = ChatOpenAI(max_tokens=3, temperature=1.0, seed=4, **base)
answer = short.invoke("Tell me a long story")
seen["short"] = {"content": answer.content, "usage": answer.response_metadata["token_usage"]}
chat = ChatOpenAI(max_tokens=12, temperature=1.0, seed=4, **base)
seen["invoke"] = chat.invoke("Go on").content
seen["batch"] = [m.content for m in chat.batch(["Go on", "Hello"])]
seen["stream"] = [chunk.content for chunk in chat.stream("Go on")]
llm = OpenAI(max_tokens=6, temperature=0, **base)
seen["completion"] = llm.invoke("Once upon a time")
seen["completions"] = llm.batch(["Once upon a time", "In the beginning"])
with open(spec["out"], "w") as f:
    json.dump(seen, f)
