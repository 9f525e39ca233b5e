"""Recovery: what the engine does when a device or one of its feeders fails — a feeder dies or
hangs (retry alone, quarantine proven poison), a batch cannot be encoded or sent, a device runs out
of memory, a device is given up or comes back.

Mixed into `Engine`; every request it cannot run again is answered through `_fail`.
"""

from __future__ import annotations

from dynbatchd import protocol as P
from dynbatchd.engine.records import MAX_RETRIES, QUARANTINE_SIZE, SUSPECT_FACTOR, SUSPECT_FLOOR_NS, Answer, Loss
from dynbatchd.scheduler import Batch, Item


class Recovery:
    """The engine's failure-handling methods (see the module docstring)."""

    def device_up(self, device: int, feeder: int = 0) -> None:
        """A feeder of `device` came up (started, restarted, or a probe of a given-up device)."""
        d = self.devices[device]
        self._devices_changed()
        d.up[feeder] = True
        d.usable, d.gone = True, False
        d.exclusive = d.exclusive and bool(d.held)   # another feeder may still run a retried request alone

    def device_gone(self, device: int, now_ns: int) -> list[Answer]:
        """A device is given up (no feeder of it is left); with none left, everything queued is
        answered unavailable."""
        d = self.devices[device]
        self._devices_changed()
        d.usable, d.gone, d.up = False, True, [False] * len(d.up)
        if not all(d.gone for d in self.devices):
            return []
        answers: list[Answer] = []
        for item in self.scheduler.take_all():
            self._fail(item, P.UNAVAILABLE, "no device is left to run this model; see the daemon's log", now_ns, answers)
        return answers

    def _out_of_memory(self, device: int, batch: Batch) -> None:
        """A batch did not fit on `device`. In a mixed pool that device's own item limit halves (as
        the worker's bisection did), leaving the bigger devices' batches alone; in a pool of alike
        devices the channel's sizer shrinks the batches for all of them."""
        if not self.mixed_pool:
            self.scheduler.out_of_memory(batch)
            return
        items, tokens = self.device_limits[device]
        self.device_limits[device] = (max(1, min(items or len(batch.items), len(batch.items) // 2)), tokens)
        self.limit_sources[device] = "learned after OOM"

    def lost(self, device: int, now_ns: int, feeder: int = 0) -> Loss:
        """A feeder of a device (its worker process) died. What it was running runs once more,
        alone; a request that kills a feeder a second time is proven poison: answered, and its
        input quarantined. So is one that hung alone (the watchdog killed its feeder, see
        overdue()): it needs no second period to prove it. What was only waiting behind it is
        requeued as it was. A feeder that pipelines (it reports a CPU stage) prepares its next
        batch while one runs, so that one is a suspect too. The device's other feeders keep what
        they hold and keep serving."""
        dev = self.devices[device]
        self._devices_changed()
        ids = dev.feeder_batches(feeder)   # in the order sent: the first was running
        held = [dev.held.pop(bid)[0] for bid in ids]
        for bid in ids:
            del dev.feeder_of[bid]
        hung = bool(held) and held[0].id in dev.hung
        dev.hung.difference_update(ids)
        dev.stats.inflight = len(dev.held)
        dev.up[feeder] = False
        dev.usable = any(dev.up) and not dev.gone
        dev.exclusive = dev.exclusive and bool(dev.held)
        answers: list[Answer] = []
        retry: list[Item] = []
        explained = False
        suspects = held[:1] if hung or not dev.prepare_ns else held[:2]
        running = [item for batch in suspects for item in batch.items]
        alone = hung and len(running) == 1
        for item in running:
            if item.retries < MAX_RETRIES and not alone:
                item.retries += 1
                retry.append(item)
                continue
            explained = True
            if self.fingerprint is not None:
                self.quarantine[self.fingerprint(item.payload)] = None
                while len(self.quarantine) > QUARANTINE_SIZE:
                    self.quarantine.popitem(last=False)
            why = "hung while running this request alone" if alone else "died twice while running this request"
            self._fail(item, P.MODEL_ERROR, f"the worker for {dev.name} {why}; its input is quarantined",
                       now_ns, answers)
        retry.extend(item for batch in held[len(suspects):] for item in batch.items)
        if self.stopped:
            for item in retry:
                self._fail(item, P.SHUTTING_DOWN, "daemon stopped while this request was running", now_ns, answers)
        else:
            self.scheduler.requeue(retry)
        return Loss(answers, explained)

    def unsendable(self, device: int, batch_id: int, bad: dict[int, str], now_ns: int) -> list[Answer]:
        """A dispatched batch could not be encoded for its worker. Its inputs that cannot be
        encoded even alone (`bad`: index -> why) are the client's fault, answered bad_request; the
        rest go back to the queue as they were. With none bad alone, the whole batch is answered
        model_error. Either way its device slot is free at once: nothing waits for a batch that
        was never sent."""
        dev = self.devices[device]
        self._devices_changed()
        entry = dev.held.pop(batch_id, None)
        dev.feeder_of.pop(batch_id, None)
        dev.stats.inflight = len(dev.held)
        if not dev.held:
            dev.exclusive = False
        answers: list[Answer] = []
        if entry is None:
            return answers
        keep = []
        for i, item in enumerate(entry[0].items):
            if i in bad:
                self._fail(item, P.BAD_REQUEST, f"this input cannot be encoded for the model's worker ({bad[i]})",
                           now_ns, answers)
            elif not bad:
                self._fail(item, P.MODEL_ERROR, "this request's batch could not be sent to the model's worker",
                           now_ns, answers)
            else:
                keep.append(item)
        self.scheduler.requeue(keep)
        return answers

    def undelivered(self, device: int, batch_id: int) -> None:
        """A dispatched batch could not be sent (its feeder vanished): it waits for another feeder
        or device, and that feeder takes nothing more until it is up again (lost() follows)."""
        dev = self.devices[device]
        self._devices_changed()
        entry = dev.held.pop(batch_id, None)
        dev.stats.inflight = len(dev.held)
        if entry is not None:
            dev.up[dev.feeder_of.pop(batch_id)] = False
            dev.usable = any(dev.up) and not dev.gone
            dev.exclusive = dev.exclusive and bool(dev.held)
            self.scheduler.requeue(entry[0].items)

    def overdue(self, now_ns: int, timeout_ns: int) -> list[tuple[int, int, int]]:
        """(device, feeder, limit) for each feeder whose running batch (its first held) has run past
        its limit: hung, to be killed; lost() then knows it hung. The limit is `timeout_ns`, except for a retried request
        running alone once its channel's cost is learned: SUSPECT_FACTOR times its estimate, at
        least SUSPECT_FLOOR_NS. So after a batch hangs, its requests rerun alone and the one that
        hangs again is found in a fraction of a second period, while the rest are answered."""
        out = []
        for i, d in enumerate(self.devices):
            running: dict[int, int] = {}   # feeder -> its running batch: the first it holds
            for bid in d.held:
                running.setdefault(d.feeder_of[bid], bid)
            for feeder, bid in running.items():
                batch, started = d.held[bid]
                limit = timeout_ns
                if any(item.retries for item in batch.items) and self.channels[batch.channel].cost.samples:
                    limit = min(timeout_ns, max(SUSPECT_FLOOR_NS, SUSPECT_FACTOR * self._estimate(batch, i)))
                if now_ns - started > limit:
                    d.hung.add(bid)
                    out.append((i, feeder, limit))
        return out
