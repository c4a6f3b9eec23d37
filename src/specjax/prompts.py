"""Built-in prompts for the demo and the benchmarks, written for this repository.

Three sets:

* ``OPEN_CHAT``: open questions, whose answers share little text with the
  prompt (a drafter must predict the model itself);
* ``GROUNDED``: input-grounded tasks, whose answers copy spans of the prompt
  (summaries, rewrites, extraction, code edits, quoting a document, chats that
  quote earlier turns): where prompt lookup (the ``ngram`` drafter) shines;
* ``EXTRACTION``: "extract these fields as JSON" over short documents, each
  with the JSON schema of its answer in ``EXTRACTION_SCHEMAS`` (same keys):
  structured output (``speculative_generate(..., json_schema=...)``), where
  the schema's keys and the document's values are in the prompt.

Each prompt is a list of chat messages (``{"role", "content"}``); apply the
tokenizer's chat template to turn it into ids.
"""

from __future__ import annotations

__all__ = ["EXTRACTION", "EXTRACTION_SCHEMAS", "GROUNDED", "OPEN_CHAT", "all_prompts"]

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


_INVOICE = (
    "INVOICE 2026-0412\nFrom: Northfield Print Ltd, 3 Mill Road, Derby\nTo: Castle Bakery, 21 High Street, "
    "Matlock\nDate: 2 April 2026. Due: 2 May 2026.\n500 x menu cards, 0.18 each: 90.00\n200 x gift vouchers, "
    "0.35 each: 70.00\nDesign work, 2 hours at 30.00: 60.00\nSubtotal 220.00, VAT 20% 44.00, total 264.00 GBP."
)

_JOB = (
    "Harbour Labs is hiring a part-time data analyst (20 hours a week) for its Bristol office, with two days "
    "a week from home. You will clean survey data, build dashboards and write short monthly reports. We ask "
    "for two years of experience with SQL and Python; knowledge of R is a plus. Salary 16,500 GBP a year. "
    "Apply by 30 June 2026 to jobs@harbourlabs.example.org, quoting reference DA-207."
)

_FLIGHT = (
    "Booking confirmed. Reference QX7M2P. Passenger: Ms Elena Ruiz. Flight IB 3167 from Madrid (MAD) to "
    "Dublin (DUB) on 12 September 2026, departing 07:35, arriving 09:10 local time. Seat 14C, economy, one "
    "checked bag of 23 kg included. Flight IB 3168 back from Dublin on 19 September 2026, departing 10:05, "
    "seat 9A. Total paid: 286.40 EUR."
)

_LISTING = (
    "To let: bright two-bedroom flat on the second floor of 8 Orchard Court, Norwich NR2 4AB. Open-plan "
    "kitchen and living room, one bathroom, small balcony facing south. Unfurnished; no lift. Rent 1,150 GBP "
    "a month, deposit five weeks' rent. Pets considered. Available from 1 August 2026. Call Tom on "
    "01603 555 018 to view."
)


def _str(*keys: str) -> dict[str, dict[str, str]]:
    return {k: {"type": "string"} for k in keys}


def _object(properties: dict[str, dict]) -> dict:
    """A JSON schema for an object with exactly ``properties``, all required."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _array(properties: dict[str, dict]) -> dict:
    return {"type": "array", "items": _object(properties)}


EXTRACTION_SCHEMAS: dict[str, dict] = {
    "order": _object(
        {
            **_str("order_number", "customer_name", "customer_id", "email"),
            "items": _array({**_str("item", "code"), "quantity": {"type": "integer"}, "price": {"type": "number"}}),
            **_str("address", "status"),
        }
    ),
    "meeting": _object(
        {
            **_str("meeting", "new_day", "time", "reason", "reply_by", "sender"),
            "bring": {"type": "array", "items": {"type": "string"}},
        }
    ),
    "library": _object(
        {
            "opened": {"type": "integer"},
            "first_building": {"type": "string"},
            "extended": {"type": "integer"},
            "first_librarian": {"type": "string"},
            "computerised": {"type": "integer"},
            "items_per_year": {"type": "integer"},
            "services": {"type": "array", "items": {"type": "string"}},
        }
    ),
    "returns": _object(
        {
            "return_days": {"type": "integer"},
            "condition": {"type": "string"},
            "refund_days": {"type": "integer"},
            "sale_items_refundable": {"type": "boolean"},
            "free_return_cases": {"type": "array", "items": {"type": "string"}},
        }
    ),
    "invoice": _object(
        {
            **_str("invoice_number", "seller", "buyer", "date", "due"),
            "lines": _array({"description": {"type": "string"}, "amount": {"type": "number"}}),
            "total": {"type": "number"},
            "currency": {"type": "string"},
        }
    ),
    "job": _object(
        {
            **_str("employer", "title", "location"),
            "hours_per_week": {"type": "integer"},
            "skills": {"type": "array", "items": {"type": "string"}},
            "salary": {"type": "integer"},
            **_str("deadline", "email", "reference"),
        }
    ),
    "flight": _object(
        {
            **_str("reference", "passenger"),
            "flights": _array(_str("flight", "from", "to", "date", "departs", "seat")),
            "total_paid": {"type": "number"},
            "currency": {"type": "string"},
        }
    ),
    "listing": _object(
        {
            **_str("address", "floor"),
            "bedrooms": {"type": "integer"},
            "furnished": {"type": "boolean"},
            "rent_per_month": {"type": "integer"},
            "pets": {"type": "boolean"},
            **_str("available_from", "contact_phone"),
        }
    ),
}

_DOCUMENTS = {
    "order": ("order record", _RECORD),
    "meeting": ("email", _EMAIL),
    "library": ("passage", _PASSAGE),
    "returns": ("returns policy", _DOCUMENT),
    "invoice": ("invoice", _INVOICE),
    "job": ("job advert", _JOB),
    "flight": ("booking confirmation", _FLIGHT),
    "listing": ("flat listing", _LISTING),
}

EXTRACTION: dict[str, list[Message]] = {
    name: [
        {
            "role": "user",
            "content": f"Extract these fields from the {what} below as JSON, with exactly the keys "
            f"{', '.join(EXTRACTION_SCHEMAS[name]['properties'])}. Reply with the JSON only.\n\n{document}",
        }
    ]
    for name, (what, document) in _DOCUMENTS.items()
}


def all_prompts() -> dict[str, dict[str, list[Message]]]:
    """``{"open": OPEN_CHAT, "grounded": GROUNDED, "extraction": EXTRACTION}``."""
    return {"open": OPEN_CHAT, "grounded": GROUNDED, "extraction": EXTRACTION}
