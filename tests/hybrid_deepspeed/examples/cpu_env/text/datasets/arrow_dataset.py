"""``Dataset``: a list of records with the ``filter``, ``map``, ``select``, ``len`` and
indexing the examples call."""


class Dataset:
    def __init__(self, records):
        self._records = list(records)

    def filter(self, keep):
        return Dataset(r for r in self._records if keep(r))

    def map(self, fn, batched=False, desc=None):
        if batched:
            raise NotImplementedError("the stand-in maps one record at a time")
        return Dataset({**r, **fn(r)} for r in self._records)

    def select(self, indices):
        return Dataset(self._records[i] for i in indices)

    def __len__(self):
        return len(self._records)

    def __getitem__(self, i):
        return self._records[i]
