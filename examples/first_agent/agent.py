"""A first agent: asks the model through the proxy and grades the answer.

    lightning-grpc runner examples/first_agent/agent.py:agent --store 127.0.0.1:4747

The runner gives each rollout its task input and the ``llm`` resource (a ``ProxyLLM``) already routed
to the attempt, so the proxy records the call, with its token ids, as a span of this attempt. The
value returned is the rollout's reward. See docs/running-agents.md for the whole walk-through.
"""

from lightning_grpc.runner import rollout
from lightning_grpc.runner.llm import openai_client
from lightning_grpc.tracing import operation
from lightning_grpc.types import LLM


@rollout
async def agent(task: dict, llm: LLM) -> float:
    client = openai_client(llm)  # the official OpenAI client, on this attempt's proxy route
    reply = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task["question"]}],
        max_tokens=8,
        temperature=1.0,
    )
    answer = reply.choices[0].message.content or ""
    with operation("grade") as op:  # a span of its own in the rollout's trace
        op.set_input(answer=answer, expected=task["expected"])
        reward = 1.0 if task["expected"] in answer else 0.0
        op.set_output(reward)
    return reward
