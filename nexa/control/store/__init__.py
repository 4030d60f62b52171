"""The controller's durable state: one SQLite database through apsw, or a shared PostgreSQL one.

Every transaction is one short sync function `verb_noun(db, ...)` wrapped whole in `with txn(db):`;
`Store.run` executes it on a single lane (one connection, CapacityLimiter(1)) off the event loop,
so no other task's SQL can interleave with a half-done transaction. Mutations append their audit
event inside the same transaction.

Callers use `from nexa.control import store as st` and the names re-exported here:
- `connection`: `open_store` (lock, migrate, new epoch), `Store` and its lanes;
- `schema`: the migrations, one list for both backends; `sql`: what every transaction function
  shares (`Db`, `txn`, the meta table);
- `audit`: the hash chain; then one module per domain: `keys` (and tenants), `nodes`, `models`,
  `deployments`, `usage` (and quotas), `workloads`, `retention` (policies, data keys, what is kept),
  `responses` (which replica keeps each stored Responses API response),
  `recovery` (the restore marker, a recovery's epoch),
  `records` (benchmark runs and jobs), `lease` (the leader's lease, the controllers, their keys' fingerprint).
The backends: `sqlite` (the adapter over apsw, with `snapshot` the only apsw importers) and, with
`[store] url` set (DESIGN §5), `pg` (the adapter over psycopg, imported only then). Each gives the
transaction functions a `sql.Db` and translates its library's errors into nexa's at home
(`StoreConflict`, `StoreBusy`, `StoreUnavailable`, `StoreUnusable`, `StoreError`): callers catch
only those.
"""

from __future__ import annotations

from nexa.control.store.audit import GENESIS_SHA256 as GENESIS_SHA256
from nexa.control.store.audit import AuditQuery as AuditQuery
from nexa.control.store.audit import append_audit as append_audit
from nexa.control.store.audit import audit_head as audit_head
from nexa.control.store.audit import event_sha256 as event_sha256
from nexa.control.store.audit import list_audit as list_audit
from nexa.control.store.audit import record_audit as record_audit
from nexa.control.store.audit import verify_audit as verify_audit
from nexa.control.store.connection import DB_FILE as DB_FILE
from nexa.control.store.connection import LOCK_FILE as LOCK_FILE
from nexa.control.store.connection import Backend as Backend
from nexa.control.store.connection import Store as Store
from nexa.control.store.connection import StoreOpener as StoreOpener
from nexa.control.store.connection import lock_state_dir as lock_state_dir
from nexa.control.store.connection import open_store as open_store
from nexa.control.store.deployments import load_deployments as load_deployments
from nexa.control.store.deployments import load_group_runs as load_group_runs
from nexa.control.store.deployments import save_deployment as save_deployment
from nexa.control.store.deployments import save_group_runs as save_group_runs
from nexa.control.store.evals import get_eval_run as get_eval_run
from nexa.control.store.evals import get_suite as get_suite
from nexa.control.store.evals import insert_eval_run as insert_eval_run
from nexa.control.store.evals import insert_suite as insert_suite
from nexa.control.store.evals import list_eval_runs as list_eval_runs
from nexa.control.store.evals import list_suites as list_suites
from nexa.control.store.keys import insert_key as insert_key
from nexa.control.store.keys import insert_tenant as insert_tenant
from nexa.control.store.keys import load_keys as load_keys
from nexa.control.store.keys import load_tenants as load_tenants
from nexa.control.store.keys import revoke_key as revoke_key
from nexa.control.store.keys import rotate_key as rotate_key
from nexa.control.store.lease import ControllerRow as ControllerRow
from nexa.control.store.lease import LeaseRow as LeaseRow
from nexa.control.store.lease import acquire_lease as acquire_lease
from nexa.control.store.lease import check_keys_fingerprint as check_keys_fingerprint
from nexa.control.store.lease import check_lease as check_lease
from nexa.control.store.lease import controllers_now as controllers_now
from nexa.control.store.lease import fenced_write as fenced_write
from nexa.control.store.lease import list_controllers as list_controllers
from nexa.control.store.lease import read_lease as read_lease
from nexa.control.store.lease import release_lease as release_lease
from nexa.control.store.lease import renew_lease as renew_lease
from nexa.control.store.lease import save_controller as save_controller
from nexa.control.store.lease import store_now as store_now
from nexa.control.store.measured import load_measured_memory as load_measured_memory
from nexa.control.store.measured import save_measured_memory as save_measured_memory
from nexa.control.store.models import insert_evaluation as insert_evaluation
from nexa.control.store.models import insert_model as insert_model
from nexa.control.store.models import insert_runtime as insert_runtime
from nexa.control.store.models import load_aliases as load_aliases
from nexa.control.store.models import load_models as load_models
from nexa.control.store.models import load_runtimes as load_runtimes
from nexa.control.store.models import save_alias as save_alias
from nexa.control.store.models import update_model as update_model
from nexa.control.store.nodes import enroll_node as enroll_node
from nexa.control.store.nodes import insert_token as insert_token
from nexa.control.store.nodes import load_nodes as load_nodes
from nexa.control.store.nodes import load_previous_keys as load_previous_keys
from nexa.control.store.nodes import load_reenrollment as load_reenrollment
from nexa.control.store.nodes import mark_needs_reenrollment as mark_needs_reenrollment
from nexa.control.store.nodes import retire_previous_keys as retire_previous_keys
from nexa.control.store.nodes import rotate_node_keys as rotate_node_keys
from nexa.control.store.nodes import save_desired as save_desired
from nexa.control.store.nodes import save_inventory as save_inventory
from nexa.control.store.nodes import update_node as update_node
from nexa.control.store.qualifications import get_qualification as get_qualification
from nexa.control.store.qualifications import insert_qualification as insert_qualification
from nexa.control.store.qualifications import latest_qualifications as latest_qualifications
from nexa.control.store.qualifications import list_qualifications as list_qualifications
from nexa.control.store.records import RUNS_KEPT_PER_DEPLOYMENT as RUNS_KEPT_PER_DEPLOYMENT
from nexa.control.store.records import RecordKey as RecordKey
from nexa.control.store.records import get_bench_run as get_bench_run
from nexa.control.store.records import get_job as get_job
from nexa.control.store.records import insert_bench_run as insert_bench_run
from nexa.control.store.records import insert_job as insert_job
from nexa.control.store.records import latest_bench_runs as latest_bench_runs
from nexa.control.store.records import list_bench_runs as list_bench_runs
from nexa.control.store.records import list_jobs as list_jobs
from nexa.control.store.records import running_job_of as running_job_of
from nexa.control.store.records import stale_jobs as stale_jobs
from nexa.control.store.records import update_job as update_job
from nexa.control.store.recovery import RECOVERY_MARKER as RECOVERY_MARKER
from nexa.control.store.recovery import end_recovery as end_recovery
from nexa.control.store.recovery import recovery_marker as recovery_marker
from nexa.control.store.responses import Pin as Pin
from nexa.control.store.responses import cap_stored_responses as cap_stored_responses
from nexa.control.store.responses import delete_stored_response as delete_stored_response
from nexa.control.store.responses import get_stored_response as get_stored_response
from nexa.control.store.responses import prune_stored_responses as prune_stored_responses
from nexa.control.store.responses import save_stored_response as save_stored_response
from nexa.control.store.retention import delete_retained as delete_retained
from nexa.control.store.retention import delete_retention_policy as delete_retention_policy
from nexa.control.store.retention import get_retained as get_retained
from nexa.control.store.retention import insert_retained as insert_retained
from nexa.control.store.retention import load_retention_policies as load_retention_policies
from nexa.control.store.retention import save_retention_policy as save_retention_policy
from nexa.control.store.retention import select_retained as select_retained
from nexa.control.store.retention import tenant_data_key as tenant_data_key
from nexa.control.store.schema import APPLICATION_ID as APPLICATION_ID
from nexa.control.store.schema import MIGRATIONS as MIGRATIONS
from nexa.control.store.sql import PRUNE_BATCH as PRUNE_BATCH
from nexa.control.store.sql import Db as Db
from nexa.control.store.usage import QUOTA_REFUSED_STATUS as QUOTA_REFUSED_STATUS
from nexa.control.store.usage import QuotaRecord as QuotaRecord
from nexa.control.store.usage import UsageKey as UsageKey
from nexa.control.store.usage import insert_usage as insert_usage
from nexa.control.store.usage import load_quotas as load_quotas
from nexa.control.store.usage import prune_usage as prune_usage
from nexa.control.store.usage import save_quota as save_quota
from nexa.control.store.usage import usage_by_second as usage_by_second
from nexa.control.store.usage import usage_report as usage_report
from nexa.control.store.usage import usage_tokens_since as usage_tokens_since
from nexa.control.store.usage import usage_units_since as usage_units_since
from nexa.control.store.workloads import WorkloadKey as WorkloadKey
from nexa.control.store.workloads import WorkloadRow as WorkloadRow
from nexa.control.store.workloads import finish_workloads as finish_workloads
from nexa.control.store.workloads import get_workload as get_workload
from nexa.control.store.workloads import insert_workload as insert_workload
from nexa.control.store.workloads import list_workloads as list_workloads
from nexa.control.store.workloads import prune_workloads as prune_workloads
from nexa.control.store.workloads import unfinished_workloads as unfinished_workloads
from nexa.control.store.workloads import workload_by_key as workload_by_key
from nexa.control.store.workloads import workload_receipt_by_key as workload_receipt_by_key
