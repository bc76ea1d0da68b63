"""JSON schemas of different shapes with a prompt each, for the structured-output tests and the
benchmark (nested objects, enums, arrays, bounded numbers, patterns, required fields)."""

S = {"type": "string", "maxLength": 24}
SCHEMAS = [
    ("a person", {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                  "required": ["name", "age"], "additionalProperties": False}),
    ("a traffic light state", {"type": "object", "properties": {"color": {"enum": ["red", "amber", "green"]}},
                               "required": ["color"]}),
    ("three fruits", {"type": "object", "properties": {"fruits": {"type": "array", "items": S, "minItems": 2,
                                                                  "maxItems": 4}}, "required": ["fruits"]}),
    ("a postal address", {"type": "object", "properties": {"address": {"type": "object", "properties": {
        "street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city", "zip"], "additionalProperties": False}}, "required": ["address"]}),
    ("today's weather", {"type": "object", "properties": {"temperature_c": {"type": "number", "minimum": -50,
                                                                            "maximum": 60}, "sunny": {"type": "boolean"}},
                         "required": ["temperature_c", "sunny"], "additionalProperties": False}),
    ("a shopping list", {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"name": S, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["name", "qty"], "additionalProperties": False}}}, "required": ["items"]}),
    ("a dice roll", {"type": "object", "properties": {"roll": {"enum": [1, 2, 3, 4, 5, 6]}}, "required": ["roll"]}),
    ("a book", {"type": "object", "properties": {"title": S, "author": S, "year": {"type": "integer", "minimum": 1400,
                                                                                    "maximum": 2030}},
                "required": ["title", "year"], "additionalProperties": False}),
    ("an airport", {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}, "city": S},
                    "required": ["code", "city"], "additionalProperties": False}),
    ("a small matrix", {"type": "object", "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                                                                  "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                                                            "items": {"type": "integer", "minimum": 0,
                                                                                      "maximum": 9}}}},
                        "required": ["rows"]}),
    ("an id that is text or a number", {"type": "object", "properties": {"id": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 9999}, {"type": "string", "maxLength": 8}]}}, "required": ["id"]}),
    ("a rectangle", {"type": "object", "properties": {"width": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                                                      "height": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                                                      "unit": {"enum": ["cm", "m"]}},
                     "required": ["width", "height", "unit"], "additionalProperties": False}),
    ("a date", {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
                "required": ["date"]}),
    ("a list of prime numbers", {"type": "array", "items": {"type": "integer", "minimum": 2, "maximum": 100},
                                 "minItems": 3, "maxItems": 5}),
    ("whether Paris is in France", {"type": "string", "enum": ["yes", "no"]}),
    ("a company with a CEO", {"type": "object", "properties": {"company": {"type": "object", "properties": {
        "name": S, "ceo": {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 18,
                                                                              "maximum": 99}},
                           "required": ["name", "age"], "additionalProperties": False}},
        "required": ["name", "ceo"], "additionalProperties": False}}, "required": ["company"]}),
    ("a pizza order", {"type": "object", "properties": {"size": {"enum": ["small", "medium", "large"]},
                                                        "toppings": {"type": "array", "maxItems": 3, "items": {
                                                            "enum": ["cheese", "ham", "olives", "mushrooms"]}}},
                       "required": ["size", "toppings"], "additionalProperties": False}),
    ("a user profile with an optional nickname", {"type": "object", "properties": {
        "username": {"type": "string", "pattern": "^[a-z]{3,10}$"}, "nickname": {"type": ["string", "null"],
                                                                              "maxLength": 12}},
        "required": ["username", "nickname"], "additionalProperties": False}),
    ("a temperature reading", {"type": "object", "properties": {"celsius": {"type": "integer", "minimum": -30,
                                                                            "maximum": 45}, "ok": {"type": "boolean"}},
                               "required": ["celsius", "ok"]}),
    ("a colour in RGB", {"type": "object", "properties": {"r": {"type": "integer", "minimum": 0, "maximum": 255},
                                                          "g": {"type": "integer", "minimum": 0, "maximum": 255},
                                                          "b": {"type": "integer", "minimum": 0, "maximum": 255}},
                         "required": ["r", "g", "b"], "additionalProperties": False}),
    ("a movie rating", {"type": "object", "properties": {"movie": S, "stars": {"type": "number", "minimum": 0,
                                                                               "maximum": 5}},
                        "required": ["movie", "stars"], "additionalProperties": False}),
    ("a sentence and its word count", {"type": "object", "properties": {"sentence": {"type": "string", "minLength": 3,
                                                                                     "maxLength": 40},
                                                                        "words": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 20}},
                                       "required": ["sentence", "words"], "additionalProperties": False}),
]

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 30},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                          "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                                          "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The current time (no arguments)",
                                      "parameters": {"type": "object", "properties": {}}}},
]
TOOL_PROMPTS = [("What is the weather in Paris?", "get_weather"), ("What is 17 plus 25?", "add"),
                ("What time is it now?", "get_time"), ("Is it raining in Tokyo? Use celsius.", "get_weather"),
                ("Add 3 and 4 for me.", "add"), ("Tell me the time, please.", "get_time")]


def prompt(what: str) -> str:
    return f"Answer with JSON only: {what}."
