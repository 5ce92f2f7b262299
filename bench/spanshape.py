"""The benchmark span: an LLM-call-like span of about 1 KB with ~20 attributes.

Pure Python with no imports beyond the standard library, so every peer (including Agent
Lightning in its own virtual environment) builds exactly the same content.
"""

from __future__ import annotations

PROMPT = (
    "You are a careful assistant. Read the policy and answer the customer's question in two "
    "sentences. Policy: refunds within 30 days with a receipt; exchanges within 60 days. "
    "Question: can I return shoes I bought five weeks ago without a receipt?"
)
COMPLETION = (
    "Without a receipt a refund is not possible, but an exchange is, because five weeks is "
    "within the 60-day exchange window. Bring the shoes to any store."
)


def span_attributes(index: int) -> dict[str, object]:
    """~20 attributes, about 1 KB in all, like one chat-completion call of an agent."""
    return {
        "gen_ai.system": "openai",
        "gen_ai.request.model": "qwen2.5-0.5b-instruct",
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.95,
        "gen_ai.request.max_tokens": 256,
        "gen_ai.prompt.0.role": "system",
        "gen_ai.prompt.0.content": "You are a helpful support agent.",
        "gen_ai.prompt.1.role": "user",
        "gen_ai.prompt.1.content": PROMPT,
        "gen_ai.completion.0.role": "assistant",
        "gen_ai.completion.0.content": COMPLETION,
        "gen_ai.completion.0.finish_reason": "stop",
        "gen_ai.response.id": f"chatcmpl-{index:012d}",
        "gen_ai.response.model": "qwen2.5-0.5b-instruct",
        "gen_ai.usage.prompt_tokens": 61,
        "gen_ai.usage.completion_tokens": 38,
        "llm.latency_ms": 412.5,
        "agent.name": "support-agent",
        "agent.turn": index % 8,
        "task.id": f"task-{index % 1000:04d}",
    }


SPAN_NAME = "openai.chat.completion"
