"""The embedded broker's transport (``filesystem://``, ``zoopick serve``'s one-machine set-up):
kombu's file-system transport, with every message written whole before a consumer can see it.

kombu's own ``Channel._put`` creates the message file under its final name (``<ms>_<uuid>.
<queue>.msg``) and then writes it; a consumer listing the folder in between takes it and reads
an empty or cut-short file, and a sender killed mid-write (the fault probe of issue 43 killed
``serve``) leaves one for good. Either way kombu's ``_get`` raises ``JSONDecodeError`` in the
worker's consumer. Here the message is written under a name no consumer matches
(``.msg.part``), flushed to disk, and renamed to its final name: a rename within a folder is
atomic, so a ``.msg`` file is always complete. A ``.part`` file a killed sender left behind
is never read (and is small: one message). A cut-short ``.msg`` written before this transport
(an older version's, or a stock kombu sender's) is dropped with an error logged instead of
stopping the consumer: its work is recovered by the sweeper, as any lost message's.

Chosen by :func:`zoopick.service.queue.make_celery` as the app's ``broker_transport`` where the
broker is the embedded one; the URL stays ``filesystem://``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from queue import Empty
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

log = logging.getLogger(__name__)

PART = ".part"
"""Suffix of a message file still being written (kombu's consumer matches ``.<queue>.msg``)."""


class Channel(filesystem.Channel):
    """kombu's file-system channel, whose messages appear only once complete."""

    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        """Write ``payload`` to a ``.part`` file, flush it to disk, then rename it into the
        queue (same name scheme as kombu's: the millisecond prefix keeps the order)."""
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        part = final + PART
        try:
            with open(part, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
                f.flush()
                os.fsync(f.fileno())  # a machine crash must not rename an empty file in
            os.replace(part, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc

    def _get(self, queue: str) -> Any:
        """The next message of ``queue``; one whose file cannot be decoded (cut short by a
        writer of an older version killed mid-write) is dropped, logged, and the queue looked
        at again on the next poll."""
        try:
            return super()._get(queue)
        except json.JSONDecodeError as exc:
            log.error(
                "dropped an unreadable message of queue %s (an empty or cut-short file, left by "
                "a sender killed mid-write): %s; its work is recovered by the sweeper",
                queue,
                exc,
            )
            raise Empty() from exc


class Transport(filesystem.Transport):
    """kombu's file-system transport with :class:`Channel`."""

    Channel = Channel


TRANSPORT = f"{__name__}:Transport"
"""What ``broker_transport`` names for the embedded broker."""
