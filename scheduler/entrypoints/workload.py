"""A mixed chat workload: short questions, half behind a long shared system prompt, mixed answer lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

from scheduler.core.params import SamplingParams

SYSTEM_PROMPT = (
    "You are Quill, the reference assistant of the Harbor Street Public Library. Follow these rules in every "
    "answer. First, be accurate: if you are not sure of a fact, say so plainly instead of guessing, and never "
    "invent book titles, authors, dates or call numbers. Second, be brief: answer in two or three sentences "
    "unless the patron asks for more detail, and put the most useful sentence first. Third, be kind and "
    "patient: patrons range from schoolchildren to retired engineers, so use plain words and explain any "
    "technical term the first time you use it. Fourth, stay on topic: help with reading, research, study "
    "skills, writing, local history and general knowledge questions; politely decline requests for medical, "
    "legal or financial advice and suggest a qualified professional instead. Fifth, protect privacy: never ask "
    "for a library card number, an address or a phone number, and never repeat personal details a patron "
    "shares. Sixth, when a question is about the library itself, remember that it opens at nine in the morning "
    "on weekdays and at ten on Saturdays, that it is closed on Sundays, that the study rooms on the second "
    "floor can be booked for two hours at a time, and that the children's corner holds a story hour every "
    "Wednesday afternoon. Seventh, end every answer with a short suggestion of something related the patron "
    "might like to read or explore next."
)

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three prime numbers.", "How do I make a cup of green tea?", "What causes the seasons on Earth?",
    "Give me a tip for remembering vocabulary.", "Why is the sky blue?", "What is a black hole?",
    "Summarize the plot of Romeo and Juliet.", "How many legs does a spider have?",
    "Suggest a name for a friendly robot.", "What is the difference between weather and climate?",
    "How do vaccines work?", "Translate 'good morning' into Spanish.", "What is the boiling point of water?",
    "Tell me a fun fact about octopuses.", "How do I start learning to program?", "What is gravity?",
    "Write a short poem about autumn leaves.", "Who painted the Mona Lisa?", "What is a noun?",
    "Why do cats purr?", "How can I improve my sleep?", "What is the largest planet in our solar system?",
    "Explain what a computer algorithm is.", "What is the water cycle?", "Give me three ideas for a picnic.",
    "How does a rainbow form?", "What is the tallest mountain in the world?", "Describe a thunderstorm.",
    "What are the primary colors?", "How do bees make honey?", "What is democracy?",
    "Recommend a classic novel for a teenager.", "What does a librarian do?", "How far away is the Moon?",
    "What is the speed of light?", "Why do leaves change color in the fall?",
    "What is a good way to study for an exam?",
]  # fmt: skip


@dataclass(frozen=True)
class ChatRequest:
    """One request of the workload: its chat messages, prompt token ids and sampling parameters."""

    request_id: str
    messages: list[dict[str, str]]
    prompt_token_ids: list[int]
    params: SamplingParams


def chat_workload(tokenizer, num_requests: int, max_tokens: int, *, seed: int = 0, shared_fraction: float = 0.5):
    """``num_requests`` chat requests; about ``shared_fraction`` of them behind :data:`SYSTEM_PROMPT`.

    Answers stop at EOS or at a per-request limit drawn from ``[max_tokens // 4, max_tokens]``.
    """
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        if rng.random() < shared_fraction:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        limit = rng.randint(max(1, max_tokens // 4), max_tokens)
        requests.append(ChatRequest(f"chat-{i}", messages, ids, SamplingParams(max_tokens=limit)))
    return requests
