"""The HTTP edge: the app and its routes, one generation request handled top to bottom, body
limits, refusal of unsupported fields, errors in OpenAI's shape, metrics and spans."""
