"""A recording stopped hard (a power cut, a kill -9 of the recorder) leaves an MCAP file without
its summary and end magic, which no indexed reader opens; its whole records before the cut are
copied into a new MCAP file with mcap's stream reader (what `mcap recover` does)."""

from __future__ import annotations

from pathlib import Path


def recover_mcap(sources: list[Path], target: Path) -> int:
    """Copy the whole records of MCAP files cut short (a recording stopped hard leaves no summary and
    no end magic) into `target`, one whole MCAP file, reading each as a stream up to its cut; the
    number of messages copied. Records from the first damaged one on, and a chunk cut in two, are
    lost (`mcap recover` does the same)."""
    from mcap.records import Channel, Header, Message, Metadata, Schema
    from mcap.stream_reader import StreamReader
    from mcap.writer import Writer

    copied, started = 0, False
    with open(target, "wb") as sink:
        writer = Writer(sink)
        for source in sources:
            schemas, channels = {0: 0}, {}  # this file's ids -> the copy's (schema 0: none)
            with open(source, "rb") as stream:
                try:
                    for record in StreamReader(stream).records:
                        if isinstance(record, Header) and not started:
                            writer.start(record.profile, record.library)
                            started = True
                        elif isinstance(record, Schema) and record.id not in schemas:
                            schemas[record.id] = writer.register_schema(record.name, record.encoding, record.data)
                        elif isinstance(record, Channel) and record.id not in channels:
                            channels[record.id] = writer.register_channel(record.topic, record.message_encoding,
                                                                          schemas.get(record.schema_id, 0), record.metadata)
                        elif isinstance(record, Message) and record.channel_id in channels:
                            writer.add_message(channels[record.channel_id], record.log_time, record.data, record.publish_time,
                                               record.sequence)
                            copied += 1
                        elif isinstance(record, Metadata):
                            writer.add_metadata(record.name, record.metadata)
                except Exception:  # the cut: the mcap reader raises errors of many kinds on it
                    pass
        if started:
            writer.finish()
    return copied
