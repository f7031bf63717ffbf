"""The Outlook cursor: each folder's delta position round-trips, folders restart alone."""

from __future__ import annotations

from datetime import UTC, datetime

from inboxd.adapters.outlook.cursor import ALL, DeltaCursor, FolderPosition, bound_of

FOLDERS = ("inbox", "sentitems")


def test_no_cursor_means_every_folder_starts_a_fresh_first_round() -> None:
    cursor = DeltaCursor.decode(None, FOLDERS)
    assert cursor.folders == {"inbox": FolderPosition(), "sentitems": FolderPosition()}
    assert all(p.link is None and p.first for p in cursor.folders.values())


def test_positions_round_trip_and_folders_restart_independently() -> None:
    cursor = (
        DeltaCursor.decode(None, FOLDERS)
        .at("inbox", "https://g/delta?$deltatoken=a", first=False)
        .at("sentitems", "https://g/delta?$skiptoken=b", first=True)
    )
    again = DeltaCursor.decode(cursor.encode(), FOLDERS)
    assert again == cursor
    restarted = DeltaCursor.decode(again.without("sentitems").encode(), FOLDERS)
    assert restarted.folders["inbox"] == FolderPosition("https://g/delta?$deltatoken=a", False)
    # a link written before bounds were kept expires to a round over the whole
    # folder, flagged backfill even after its first round ended
    assert restarted.folders["sentitems"] == FolderPosition(None, True, ALL)
    assert again.without("inbox").folders["inbox"] == FolderPosition(None, True, ALL)


def test_an_expired_folder_restarts_with_the_bound_of_its_first_round() -> None:
    since = "2026-11-02T09:30:00Z"
    cursor = (
        DeltaCursor.decode(None, FOLDERS)
        .bounded("inbox", since)
        .at("inbox", "https://g/delta?$skiptoken=a", first=True)
        .at("inbox", "https://g/delta?$deltatoken=b", first=False)
    )
    assert DeltaCursor.decode(cursor.encode(), FOLDERS) == cursor
    expired = DeltaCursor.decode(cursor.without("inbox").encode(), FOLDERS)
    # not a first round (no backfill flag), and the same receivedDateTime bound
    assert expired.folders["inbox"] == FolderPosition(None, False, since)
    assert expired.folders["inbox"].since_time == datetime(2026, 11, 2, 9, 30, tzinfo=UTC)
    # a folder that never started stays fresh: its first round takes the backfill
    assert expired.without("sentitems").folders["sentitems"] == FolderPosition()
    assert bound_of(None) == ALL


def test_folders_no_longer_synced_are_dropped_and_new_ones_start_fresh() -> None:
    old = DeltaCursor.decode(None, ("inbox", "archive")).at("archive", "L", first=False)
    cursor = DeltaCursor.decode(old.encode(), FOLDERS)
    assert set(cursor.folders) == set(FOLDERS)
    assert cursor.folders["sentitems"] == FolderPosition()


def test_a_cursor_of_another_shape_starts_every_folder_fresh() -> None:
    for text in ("12345", '{"v": 99}', "not json", '{"v": 1, "folders": []}'):
        assert DeltaCursor.decode(text, FOLDERS) == DeltaCursor.decode(None, FOLDERS)
