"""Prompt building: instruction templates per family, rendered with the model's chat template when it has one."""

from __future__ import annotations

from typing import Any

MATH_INSTRUCTION = (
    "Solve the following problem. Reason step by step, and put your final answer within \\boxed{{}}.\n\n{problem}"
)

MC_INSTRUCTION = (
    "Answer the following multiple choice question. The last line of your response should be of the form "
    "'Answer: $LETTER' where LETTER is one of {letters}.\n\n{question}\n\n{choices}"
)

MC_DIRECT_INSTRUCTION = (
    "The following is a multiple choice question{topic}. Reply with the letter of the correct answer only.\n\n"
    "{question}\n\n{choices}"
)

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Return the whole function in one ```python code block.\n\n"
    "```python\n{prompt}```"
)

# `benchmark.extra.answer_start=function`: the assistant's answer opens with the function's signature and
# docstring in a code block (as bigcode-evaluation-harness's instruct HumanEval does), so the model writes
# the body instead of first copying the prompt; the user turn then only asks for it.
HUMANEVAL_CONTINUE_INSTRUCTION = "Complete the Python function that begins your answer. Return it in one ```python code block."

LCB_INSTRUCTION = (
    "You will be given a programming problem. Write a correct Python 3 program that solves it. "
    "{io_note} Return the program in one ```python code block.\n\n{question}"
)
LCB_STDIN_NOTE = "Read the input from standard input and write the answer to standard output."
LCB_FUNCTIONAL_NOTE = "Complete the given starter code:\n\n```python\n{starter}\n```\n"

NIAH_SUFFIX_PREFIX = "Answer: "


def choices_block(choices: list[str]) -> str:
    """Lettered choices, one per line."""
    return "\n".join(f"{chr(65 + i)}. {c}" for i, c in enumerate(choices))


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer: Any, user: str, system: str | None = None, use_chat: bool = True,
           assistant_prefix: str = "") -> str:
    """Prompt text for generation: the chat template (with generation prompt) when the model has one.

    `assistant_prefix` is appended after the generation prompt (e.g. "Answer:" for one-token scoring).
    Without a chat template the plain form is "<system>\\n\\n<user>\\n\\n<assistant_prefix>".
    """
    if use_chat and tokenizer is not None and has_chat_template(tokenizer):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + assistant_prefix
    parts = ([system] if system else []) + [user]
    return "\n\n".join(parts) + "\n\n" + assistant_prefix
