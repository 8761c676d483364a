"""The service core both faces stand on: settings, the database, a job's lifecycle
(``pipeline``, ``recovery``), the dataset and zoo stores, API keys, and the queue contract
(``queue``, ``dispatch``). No HTTP and no task bodies here."""
