//! What the admin API shows of a running gateway and the actions it takes, in both modes:
//! sources, connectors with their tasks, lag and rate, pause and resume of a connector or
//! one task, the cluster's workers, webhook sources, the catalog and the OpenAPI document;
//! every answer checked against that document.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::json;
use sluice_tests::admin::{gateway, Api};
use sluice_tests::in_both_modes;

in_both_modes!(sources_connectors_and_the_cluster_are_shown_and_acted_on);

async fn sources_connectors_and_the_cluster_are_shown_and_acted_on(distributed: bool) {
    let sluice = gateway(distributed, "admin-connectors").await;
    let api = Api::recorded(&sluice);

    let sources = api.get("/api/v1/sources", "/api/v1/sources").await;
    assert_eq!(sources.status, 200);

    // The sample rule's connector: one task per shard, with its lag and rate.
    let connectors = api.get("/api/v1/connectors", "/api/v1/connectors").await;
    assert_eq!(connectors.status, 200);
    let one = &connectors.body["items"][0];
    assert_eq!(
        one["id"], "default/all-events/delivered",
        "{}",
        connectors.body
    );
    assert_eq!(one["tasks"].as_array().unwrap().len(), 4);
    assert!(one["tasks"][0]["lag"].is_u64(), "{one}");
    assert!(one.get("rate").is_some(), "{one}");
    let connector = api
        .get(
            "/api/v1/connectors/{bus}/{rule}/{target}",
            "/api/v1/connectors/default/all-events/delivered",
        )
        .await;
    assert_eq!(connector.status, 200);

    // Pause the connector, resume one task, then all of it.
    let action = "/api/v1/connectors/{bus}/{rule}/{target}/{action}";
    let task_action = "/api/v1/connectors/{bus}/{rule}/{target}/tasks/{shard}/{action}";
    for (template, path) in [
        (
            action,
            "/api/v1/connectors/default/all-events/delivered/pause",
        ),
        (
            task_action,
            "/api/v1/connectors/default/all-events/delivered/tasks/1/resume",
        ),
        (
            action,
            "/api/v1/connectors/default/all-events/delivered/resume",
        ),
    ] {
        assert_eq!(api.post(template, path, None).await.status, 202, "{path}");
    }

    let cluster = api.get("/api/v1/cluster", "/api/v1/cluster").await;
    assert_eq!(cluster.status, 200);
    assert_eq!(cluster.body["strategy"], "sorted-hash");
    let workers = cluster.body["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 1, "{}", cluster.body);
    assert!(
        workers[0]["heartbeat_age_ms"].as_u64().unwrap() < 5_000,
        "{}",
        cluster.body
    );
    let hooks = api.get("/api/v1/webhooks", "/api/v1/webhooks").await;
    assert_eq!(hooks.status, 200);
    assert_eq!(hooks.body["items"], json!([]));
    let catalog = api.get("/api/v1/catalog", "/api/v1/catalog").await;
    assert_eq!(catalog.status, 200);
    let doc = api
        .get("/api/v1/openapi.json", "/api/v1/openapi.json")
        .await;
    assert_eq!(doc.status, 200);
    assert_eq!(doc.body["openapi"], "3.1.0");
    api.check_openapi("connectors");
}
