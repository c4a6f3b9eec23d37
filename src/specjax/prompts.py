"""Built-in prompts for the demo and the benchmarks, written for this repository.

Two sets:

* ``OPEN_CHAT``: open questions, whose answers share little text with the
  prompt (a drafter must predict the model itself);
* ``GROUNDED``: input-grounded tasks, whose answers copy spans of the prompt
  (summaries, rewrites, extraction, code edits, quoting a document, chats that
  quote earlier turns): where prompt lookup (the ``ngram`` drafter) shines.

Each prompt is a list of chat messages (``{"role", "content"}``); apply the
tokenizer's chat template to turn it into ids.
"""

from __future__ import annotations

__all__ = ["GROUNDED", "OPEN_CHAT", "all_prompts"]

Message = dict[str, str]

OPEN_CHAT: dict[str, list[Message]] = {
    "capital": [{"role": "user", "content": "What is the capital of France, and what is it famous for?"}],
    "poem": [{"role": "user", "content": "Write a short poem about the sea."}],
    "program": [{"role": "user", "content": "Explain in simple terms what a computer program is."}],
    "health": [{"role": "user", "content": "Give three tips for staying healthy."}],
    "bicycle": [{"role": "user", "content": "Describe how a bicycle works."}],
    "sky": [{"role": "user", "content": "Why is the sky blue?"}],
}

_PASSAGE = (
    "The town library opened in 1921 in a former grain store near the river. For its first forty years it "
    "was run by volunteers, who lent books from a single room and kept the catalogue on index cards. In 1962 "
    "the council bought the building next door, doubled the floor space and hired the first paid librarian, "
    "Margaret Hale, who started a reading club for children and a weekly film evening. The library moved its "
    "catalogue to computers in 1994. Today it lends about 80,000 items a year, runs language classes for "
    "adults, and keeps a local history archive with photographs of the river port."
)

_EMAIL = (
    "hi team,\n\nso the quarterly review meeting is moved from thursday to friday at 10am because the "
    "projector in room 4 is broken and facilities cant fix it before friday. please bring your updated "
    "numbers and the slides you prepared. if you cant make it let me know by wednesday so i can send you "
    "the recording.\n\nthanks,\nDana"
)

_RECORD = (
    "Order #58213 was placed on 2026-03-14 by customer Jonas Berg (customer id C-7741, email "
    "jonas.berg@example.com). Items: 2 x ceramic mug (item M-12, 9.50 each), 1 x teapot (item T-03, 32.00). "
    "Shipping to 14 Harbour Lane, Leith, EH6 6LP, by standard post. Payment by card ending 4417. Status: "
    "shipped on 2026-03-16."
)

_CODE = """def average(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2
"""

_DOCUMENT = (
    "Section 4. Returns. Items may be returned within 30 days of delivery if they are unused and in their "
    "original packaging. Refunds are paid to the original payment method within 5 working days of the item "
    "arriving at our warehouse. Sale items can be exchanged but not refunded. Customers pay the return "
    "postage unless the item arrived damaged or was sent in error, in which case we send a prepaid label."
)

GROUNDED: dict[str, list[Message]] = {
    "summarise": [{"role": "user", "content": f"Summarise this passage in three sentences.\n\n{_PASSAGE}"}],
    "rewrite-email": [
        {
            "role": "user",
            "content": "Rewrite this email with correct capitalisation and "
            f"punctuation, keeping every detail:\n\n{_EMAIL}",
        }
    ],
    "extract": [
        {
            "role": "user",
            "content": "Extract the order number, customer name, customer id, email, "
            "items with prices, address and status from this record, one "
            f"field per line as 'field: value'.\n\n{_RECORD}",
        }
    ],
    "edit-code": [
        {
            "role": "user",
            "content": "Add a docstring to each function and make average return 0 "
            "for an empty list. Show the whole file.\n\n```python\n"
            f"{_CODE}```",
        }
    ],
    "answer-from-doc": [
        {
            "role": "user",
            "content": f"{_DOCUMENT}\n\nQuoting the policy above, answer: can I "
            "get a refund for a sale item, and who pays the return "
            "postage for a damaged item?",
        }
    ],
    "multi-turn": [
        {"role": "user", "content": "My shopping list is: eggs, flour, milk, butter, apples, cinnamon, sugar."},
        {"role": "assistant", "content": "Got it. Your list is: eggs, flour, milk, butter, apples, cinnamon, sugar."},
        {
            "role": "user",
            "content": "I already have milk and sugar. Repeat my list without them, then say what "
            "I could bake with it.",
        },
    ],
}


def all_prompts() -> dict[str, dict[str, list[Message]]]:
    """``{"open": OPEN_CHAT, "grounded": GROUNDED}``."""
    return {"open": OPEN_CHAT, "grounded": GROUNDED}
