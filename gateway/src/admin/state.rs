//! What the admin API works on: the catalog, the admin credentials, admission, the running
//! plan, the cluster, positions, replays and the scaling history; ingress's state beside
//! it (webhook sources served, buses). Made once, when the gateway has them all.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::{Map, Value};
use tokio::sync::watch;

use crate::admin::auth::AdminAuth;
use crate::admission::Admission;
use crate::catalog::{Catalog, Snapshot};
use crate::ingress::state::IngressState;
use crate::problem::Problem;
use crate::replay::{Cancels, ReplayStore};
use crate::runtime::Plan;
use crate::scaling::History;
use crate::store::cluster::Cluster;
use crate::store::PositionStore;

pub struct AdminState {
    pub ingress: Arc<IngressState>,
    pub cluster: Arc<dyn Cluster>,
    pub catalog: Catalog,
    pub auth: Arc<AdminAuth>,
    /// What the admin API checks before it accepts a change: that this replica can build it.
    pub admission: Arc<Admission>,
    /// Read (never written) by the connector views and the scaling signal.
    pub positions: Arc<dyn PositionStore>,
    pub scaling: History,
    /// Where replay statuses are kept, and the cancel switch of each replay running here.
    pub replays: Arc<dyn ReplayStore>,
    pub replay_cancels: Arc<Cancels>,
    /// The running plan, as the worker runs it.
    plans: watch::Receiver<Arc<Plan>>,
}

impl AdminState {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ingress: Arc<IngressState>,
        cluster: Arc<dyn Cluster>,
        catalog: Catalog,
        auth: AdminAuth,
        admission: Admission,
        positions: Arc<dyn PositionStore>,
        replays: Arc<dyn ReplayStore>,
        plans: watch::Receiver<Arc<Plan>>,
    ) -> AdminState {
        AdminState {
            ingress,
            cluster,
            catalog,
            auth: Arc::new(auth),
            admission: Arc::new(admission),
            positions,
            scaling: History::default(),
            replays,
            replay_cancels: Arc::default(),
            plans,
        }
    }

    /// The running plan.
    pub fn plan(&self) -> Arc<Plan> {
        self.plans.borrow().clone()
    }

    /// The webhook sources ingress serves.
    pub fn webhooks(&self) -> Arc<crate::ingress::webhooks::source::Webhooks> {
        self.ingress.settings().webhooks.clone()
    }

    /// The connectors of the running plan and their number of tasks (the admin API refuses
    /// to act on anything else).
    pub fn connectors(&self) -> Arc<HashMap<String, u32>> {
        self.plan().connectors()
    }
}

pub(crate) fn store_problem(e: &crate::store::StoreError) -> Problem {
    Problem::unavailable(format!("the catalog cannot be read or written: {e}"), 2)
}

/// The catalog's current snapshot, for handlers that only read it.
pub(crate) async fn snapshot_of(state: &AdminState) -> Result<Snapshot, Problem> {
    state
        .catalog
        .snapshot()
        .await
        .map_err(|e| store_problem(&e))
}

/// A request body that must be a JSON object.
pub(crate) fn json_object(body: &[u8]) -> Result<Map<String, Value>, Problem> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(Problem::invalid_resource(
            "",
            "the body must be a JSON object",
        )),
        Err(e) => Err(Problem::invalid_resource(
            "",
            format!("the body is not JSON: {e}"),
        )),
    }
}

/// A request body that must be a JSON object of these fields (each optional).
pub(crate) fn json_request(body: &[u8], fields: &[&str]) -> Result<Map<String, Value>, Problem> {
    let request = json_object(body)?;
    if let Some(key) = request.keys().find(|k| !fields.contains(&k.as_str())) {
        return Err(Problem::invalid_resource(
            &format!("/{key}"),
            format!("unknown field `{key}` ({})", fields.join(", ")),
        ));
    }
    Ok(request)
}

/// The `event` field of a request: a structured-mode CloudEvent, not yet read.
pub(crate) fn event_field(request: &Map<String, Value>) -> Result<&Value, Problem> {
    request.get("event").ok_or_else(|| {
        Problem::invalid_resource(
            "/event",
            "`event` (a structured-mode CloudEvent) is required",
        )
    })
}

/// The `key=value` pairs of a query string; a key without `=` has the value `bare`.
pub(crate) fn query_pairs<'a>(
    query: Option<&'a str>,
    bare: &'a str,
) -> impl Iterator<Item = (&'a str, &'a str)> {
    query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .map(move |pair| pair.split_once('=').unwrap_or((pair, bare)))
}

impl crate::scaling::Observed for AdminState {
    fn history(&self) -> &History {
        &self.scaling
    }

    fn positions(&self) -> &Arc<dyn PositionStore> {
        &self.positions
    }

    fn buses(&self) -> Arc<HashMap<String, Arc<dyn crate::store::BusLog>>> {
        self.ingress.settings().buses.clone()
    }

    fn connectors(&self) -> Arc<HashMap<String, u32>> {
        AdminState::connectors(self)
    }

    fn cluster(&self) -> &Arc<dyn Cluster> {
        &self.cluster
    }
}
