"""tito's public names: a change to this list is a change to the package's contract."""

import tito


def test_public_names_are_pinned():
    assert sorted(tito.__all__) == [
        "Capture", "ChatRenderer", "ChatState", "ContextFull", "EngineNonFinite", "EngineUnavailable",
        "ExpansionMismatch", "Generation", "ImageSpan", "Prompt", "Segment", "Session", "Tito", "Trajectory",
        "Turn", "create_app", "serve_on_loop",
    ]  # fmt: skip
    assert all(hasattr(tito, name) for name in tito.__all__)
