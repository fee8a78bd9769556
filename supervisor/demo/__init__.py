"""`sfguard demo`: the example pipeline against the fixture login site."""
