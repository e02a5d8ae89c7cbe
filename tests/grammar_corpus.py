"""A corpus of constraints for structured-generation tests and benchmarks: 50 JSON schemas
(nested objects, bounded arrays, enums, numbers with ranges, strings with patterns and
formats, optional and required fields) and 20 regexes, each with a request for the model.

Every constraint bounds its output (string lengths, item counts, digit counts; the formats
used, date, uuid and ipv4, are bounded by nature), so an output always ends within
``MAX_NEW_TOKENS``: a constrained output cut by the budget would not validate.
"""

from __future__ import annotations

MAX_NEW_TOKENS = 320


def _string(max_length: int = 24, **extra) -> dict:
    return {"type": "string", "maxLength": max_length, **extra}


def _integer(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required}


NAME = _string(20, minLength=1)
EMAIL = {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,10}\\.(com|org)$"}
"""A pattern, not ``format: email``: that format is unbounded (and xgrammar ignores a
pattern given with a format)."""
DATE = {"type": "string", "format": "date"}
UUID = {"type": "string", "format": "uuid"}
IPV4 = {"type": "string", "format": "ipv4"}
PRICE = {"type": "number", "minimum": 0, "maximum": 10000}
RATING = {"type": "number", "minimum": 0, "maximum": 5}
WORDS = {"type": "array", "items": _string(16), "minItems": 1, "maxItems": 3}
ADDRESS = _object({"street": _string(30), "city": NAME,
                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})

JSON_SCHEMAS: list[tuple[str, dict]] = [
    ("a person", _object({"name": NAME, "age": _integer(0, 120)})),
    ("a person with an email", _object({"name": NAME, "email": EMAIL})),
    ("a city", _object({"city": NAME, "country": NAME, "population": _integer(0, 40_000_000)})),
    ("a book", _object({"title": _string(40), "author": NAME, "year": _integer(1400, 2025)})),
    ("a movie rating", _object({"movie": _string(40), "stars": RATING})),
    ("a product", _object({"name": NAME, "price": PRICE, "in_stock": {"type": "boolean"}})),
    ("a color", _object({"color": {"enum": ["red", "green", "blue", "yellow"]}})),
    ("a traffic light state", _object({"light": {"enum": ["red", "amber", "green"]},
                                       "seconds": _integer(1, 120)})),
    ("a date of an event", _object({"event": _string(30), "date": DATE})),
    ("a server", _object({"host": NAME, "ip": IPV4, "port": _integer(1, 65535)})),
    ("a user account", _object({"id": UUID, "username": {"type": "string",
                                                          "pattern": "^[a-z][a-z0-9_]{2,11}$"}})),
    ("a shopping list", _object({"items": WORDS})),
    ("a list of three numbers", _object({"numbers": {"type": "array", "items": _integer(0, 99),
                                                      "minItems": 3, "maxItems": 3}})),
    ("a pet", _object({"name": NAME, "species": {"enum": ["cat", "dog", "bird", "fish"]},
                       "age": _integer(0, 30)})),
    ("an address", ADDRESS),
    ("a person with an address", _object({"name": NAME, "address": ADDRESS})),
    ("a company", _object({"name": NAME, "employees": _integer(1, 100000),
                           "public": {"type": "boolean"}})),
    ("a temperature reading", _object({"celsius": {"type": "number", "minimum": -50,
                                                   "maximum": 60},
                                       "unit": {"const": "C"}})),
    ("a recipe", _object({"dish": NAME, "ingredients": WORDS, "minutes": _integer(1, 600)})),
    ("a song", _object({"title": _string(30), "artist": NAME,
                        "duration_seconds": _integer(30, 900)})),
    ("a student grade", _object({"student": NAME, "grade": {"enum": ["A", "B", "C", "D", "F"]}})),
    ("a phone contact", _object({"name": NAME, "phone": {"type": "string",
                                                          "pattern": "^[0-9]{3}-[0-9]{4}$"}})),
    ("a flight", _object({"from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                          "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                          "date": DATE})),
    ("a point on a map", _object({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                  "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
    ("a rectangle", _object({"width": _integer(1, 1000), "height": _integer(1, 1000)})),
    ("a task", _object({"title": _string(40), "done": {"type": "boolean"},
                        "priority": _integer(1, 5)})),
    ("a weather forecast", _object({"city": NAME, "sky": {"enum": ["sunny", "cloudy", "rain"]},
                                    "high": _integer(-30, 50), "low": _integer(-40, 40)})),
    ("a car", _object({"make": NAME, "model": NAME, "year": _integer(1950, 2025)})),
    ("a bank transfer", _object({"from": UUID, "to": UUID, "amount": PRICE})),
    ("a tweet", _object({"user": NAME, "text": _string(60), "likes": _integer(0, 10000)})),
    ("an optional nickname", _object({"name": NAME, "nickname": NAME}, required=["name"])),
    ("a profile with optional fields", _object(
        {"name": NAME, "age": _integer(0, 120), "city": NAME}, required=["name"])),
    ("a team", _object({"team": NAME, "members": {"type": "array", "items": NAME,
                                                  "minItems": 1, "maxItems": 4}})),
    ("a pair of players", _object({"players": {"type": "array",
                                               "items": _object({"name": NAME,
                                                                 "score": _integer(0, 100)}),
                                               "minItems": 2, "maxItems": 2}})),
    ("an order", _object({"order_id": _integer(1, 999999), "items": {
        "type": "array", "items": _object({"sku": {"type": "string",
                                                   "pattern": "^[A-Z]{2}[0-9]{3}$"},
                                           "qty": _integer(1, 20)}),
        "minItems": 1, "maxItems": 3}})),
    ("a nested config", _object({"server": _object({"host": NAME, "port": _integer(1, 65535)}),
                                 "debug": {"type": "boolean"}})),
    ("a yes-or-no answer", _object({"answer": {"enum": ["yes", "no"]},
                                    "confidence": RATING})),
    ("a country", _object({"name": NAME, "capital": NAME,
                           "continent": {"enum": ["Africa", "Asia", "Europe", "America",
                                                  "Oceania"]}})),
    ("a hex color", _object({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("a version number", _object({"major": _integer(0, 99), "minor": _integer(0, 99),
                                  "patch": _integer(0, 99)})),
    ("a log entry", _object({"level": {"enum": ["debug", "info", "warning", "error"]},
                             "message": _string(60), "date": DATE})),
    ("a meeting", _object({"topic": _string(40), "date": DATE,
                           "attendees": {"type": "array", "items": EMAIL, "maxItems": 2}})),
    ("a scoreboard", _object({"home": _integer(0, 20), "away": _integer(0, 20),
                              "final": {"type": "boolean"}})),
    ("a planet", _object({"name": NAME, "moons": _integer(0, 100),
                          "has_rings": {"type": "boolean"}})),
    ("an animal fact", _object({"animal": NAME, "fact": _string(80)})),
    ("a language", _object({"language": NAME, "speakers_millions": _integer(0, 2000),
                            "family": _string(20)})),
    ("a null-or-number field", _object({"value": {"anyOf": [{"type": "null"},
                                                             _integer(0, 100)]}})),
    ("a list of tags", {"type": "array", "items": {"enum": ["new", "sale", "hot", "eco"]},
                        "minItems": 1, "maxItems": 3}),
    ("a matrix", _object({"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                                   "items": {"type": "array", "items": _integer(0, 9),
                                             "minItems": 2, "maxItems": 2}}})),
    ("a library", _object({"name": NAME, "books": {"type": "array", "maxItems": 2,
                                                   "items": _object({"title": _string(30),
                                                                     "year": _integer(1400,
                                                                                      2025)})}})),
]

_OCTET = r"(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"
REGEXES: list[tuple[str, str]] = [
    ("a phone number", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"),
    ("an email address", r"[a-z]{1,10}\.[a-z]{1,10}@[a-z]{2,10}\.(com|org|net)"),
    ("a date", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("a time", r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("an IPv4 address", rf"({_OCTET}\.){{3}}{_OCTET}"),
    ("a yes or no answer", r"(Yes|No)\."),
    ("a price in dollars", r"\$[1-9][0-9]{0,3}\.[0-9]{2}"),
    ("a hex color", r"#[0-9A-F]{6}"),
    ("a US zip code", r"[0-9]{5}(-[0-9]{4})?"),
    ("a capitalised name", r"[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}"),
    ("a percentage", r"(100|[1-9]?[0-9])%"),
    ("a temperature", r"-?[0-9]{1,2} degrees (Celsius|Fahrenheit)"),
    ("a short answer sentence", r"The answer is [a-z]{1,12}\."),
    ("a multiple choice answer", r"Answer: [ABCD]"),
    ("a version string", r"v[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,3}"),
    ("a list of three fruits", r"(apple|banana|cherry|grape), (apple|banana|cherry|grape), "
                               r"(apple|banana|cherry|grape)"),
    ("a rating out of ten", r"([0-9]|10)/10"),
    ("a year", r"(1[89][0-9]{2}|20[0-2][0-9])"),
    ("a file name", r"[a-z_]{1,16}\.(txt|csv|json|py)"),
    ("a greeting", r"(Hello|Hi|Good morning), [A-Z][a-z]{1,10}!"),
]


def json_prompt(what: str) -> str:
    return f"Reply with a JSON object for {what}."


def regex_prompt(what: str) -> str:
    return f"Reply with {what} only."
