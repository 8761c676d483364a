"""Datasets, the service's side: where they are stored and how they are validated
(:mod:`.store`), and how an upload is admitted (:mod:`.admission`: format, quota, insert, then
validation in the request or queued). The REST router (``app/api/datasets.py``) and the dashboard
(``app/dashboard/pages.py``) are thin adapters over :mod:`.admission`, as they are over
``service/jobs.py`` for jobs.
"""

from zoopick.service.datasets.store import (
    DECODED,
    dataset_dir,
    dataset_key,
    dataset_prefix,
    decoded_dir,
    detect_format,
    fail_validation,
    feature_cache,
    for_scoring,
    format_suffix,
    is_local,
    on_this_machine,
    owned_path,
    remove_files,
    run_data,
    safe_filename,
    validate,
)

__all__ = [
    "DECODED",
    "dataset_dir",
    "dataset_key",
    "dataset_prefix",
    "decoded_dir",
    "detect_format",
    "fail_validation",
    "feature_cache",
    "for_scoring",
    "format_suffix",
    "is_local",
    "on_this_machine",
    "owned_path",
    "remove_files",
    "run_data",
    "safe_filename",
    "validate",
]
