"""20 JSON schemas and 3 prompts for structured-output tests (tests/test_structured_server.py): nested objects,
arrays, enums, numbers, optional fields, strings with patterns, $ref, anyOf, nullable fields."""

PROMPTS = [
    "What is 17 + 25? Answer in JSON.",
    "Describe the weather in Paris as JSON.",
    "Make up a person and give their details as JSON.",
]

_NAME = {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"}

SCHEMAS = [
    # 0 a single integer field
    {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]},
    # 1 a boolean and a number
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "value": {"type": "number"}},
     "required": ["ok", "value"]},
    # 2 a string with a pattern
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"}},
     "required": ["code"]},
    # 3 an enum
    {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit", "kelvin"]},
                                      "temp": {"type": "number"}}, "required": ["unit", "temp"]},
    # 4 optional fields only
    {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                      "population": {"type": "integer"}}},
    # 5 a nested object
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}}, "required": ["name", "age"]}},
     "required": ["person"]},
    # 6 an array of integers with bounds on its length
    {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"}, "minItems": 1,
                                                  "maxItems": 4}}, "required": ["numbers"]},
    # 7 an array of objects
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "label": {"type": "string", "maxLength": 12}},
        "required": ["id", "label"]}}}, "required": ["items"]},
    # 8 a top-level array of enums
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 5},
    # 9 nullable through a type list
    {"type": "object", "properties": {"note": {"type": ["string", "null"]}, "score": {"type": "number"}},
     "required": ["note", "score"]},
    # 10 anyOf of two shapes
    {"type": "object", "properties": {"result": {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {
        "error": {"type": "string"}}, "required": ["error"]}]}}, "required": ["result"]},
    # 11 a const and a number range
    {"type": "object", "properties": {"version": {"const": 2}, "ratio": {"type": "number", "minimum": 0,
                                                                         "maximum": 1}},
     "required": ["version", "ratio"]},
    # 12 $defs and $ref
    {"type": "object", "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                           "y": {"type": "integer"}},
                                           "required": ["x", "y"]}},
     "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
     "required": ["start", "end"]},
    # 13 deep nesting: object > array > object > enum
    {"type": "object", "properties": {"plan": {"type": "object", "properties": {"steps": {"type": "array",
        "maxItems": 2, "items": {"type": "object", "properties": {"kind": {"enum": ["add", "sub"]},
                                                                   "by": {"type": "integer"}},
                                 "required": ["kind", "by"]}}}, "required": ["steps"]}}, "required": ["plan"]},
    # 14 a date-like pattern and an email-like pattern
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                      "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
     "required": ["date", "email"]},
    # 15 a required field and optional ones around it
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"}},
     "required": ["b"]},
    # 16 an integer enum and a string length
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "tag": {"type": "string", "minLength": 2,
                                                                             "maxLength": 6}},
     "required": ["level", "tag"]},
    # 17 a top-level string with a pattern
    {"type": "string", "pattern": "^(yes|no|maybe)$"},
    # 18 an object with a free map of numbers
    {"type": "object", "properties": {"scores": {"type": "object", "additionalProperties": {"type": "number"},
                                                 "maxProperties": 3}}, "required": ["scores"]},
    # 19 a person record: strings, numbers, arrays, nested optional address
    {"type": "object", "properties": {
        "name": _NAME, "age": {"type": "integer", "minimum": 0}, "tags": {"type": "array", "items":
                                                                          {"type": "string"}, "maxItems": 2},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                          "pattern": "^[0-9]{5}$"}},
                    "required": ["city"]}}, "required": ["name", "age"]},
]
