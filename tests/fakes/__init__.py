"""Fakes of providers inboxd cannot reach from a test (CONTRIBUTING.md rule 12).

Each fake follows the provider's published API contract and is reached over real
HTTP by the real client code. Import them as `fakes.<provider>` (pyproject's
pytest `pythonpath` puts tests/ on sys.path).
"""
