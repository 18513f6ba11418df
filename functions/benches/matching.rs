//! Events matched per second against 1, 100 and 10 000 rules, and transforms per second,
//! on a realistic ~1 KiB CloudEvent whose data is already parsed (`Data::Json`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::time::Duration;

use cloudevents::Event;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use serde_json::{json, Value};
use sluice_functions::{CesqlFilter, Pattern, RuleIndex, TransformChain};

fn event() -> Event {
    let ev = json!({
        "specversion": "1.0",
        "id": "7f1c2a9e-4b7d-4a55-9d1e-0c3b5f2a9e11",
        "source": "/orders/eu-west-1/checkout",
        "type": "com.example.order.created",
        "subject": "order/2024/05/000123456",
        "time": "2024-05-01T10:00:00Z",
        "datacontenttype": "application/json",
        "region": "eu-west-1",
        "tenant": "acme",
        "data": {
            "orderId": "000123456",
            "status": "CREATED",
            "total": 249.9,
            "currency": "EUR",
            "customer": {"id": "c-981", "tier": "gold", "email": "ann@example.com", "country": "DE",
                         "ip": "10.12.4.7"},
            "items": [
                {"sku": "SKU-1001", "name": "Trail running shoes", "qty": 1, "price": 129.9},
                {"sku": "SKU-2002", "name": "Merino socks (3 pack)", "qty": 2, "price": 30.0},
                {"sku": "SKU-3003", "name": "Water bottle 750ml", "qty": 1, "price": 60.0}
            ],
            "shipping": {"method": "express", "address": {"street": "Hauptstrasse 1",
                         "city": "Berlin", "zip": "10115", "country": "DE"}},
            "payment": {"method": "card", "brand": "visa", "last4": "4242", "captured": true},
            "tags": ["new-customer", "promo-spring", "mobile"],
            "notes": "Leave the parcel with the neighbour if nobody is at home, please.",
            "channel": {"app": "shop-ios", "version": "5.12.3", "session": "s-5b1e0c7d2f9a4e31",
                        "campaign": "spring-2024-running", "referrer": "https://example.com/blog/trail"}
        }
    });
    serde_json::from_value(ev).unwrap()
}

/// `n` rules in the shapes a bus typically has; only a handful match the event.
fn rules(n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| match i % 8 {
            0 => json!({"type": [format!("com.example.type{i}")]}),
            1 => json!({"source": [{"prefix": format!("/svc{i}/")}]}),
            2 => json!({"type": ["com.example.order.created"], "data": {"customer": {"tier": [format!("tier{i}")]}}}),
            3 => json!({"data": {"total": [{"numeric": [">=", i as f64, "<", i as f64 + 10.0]}]}}),
            4 => json!({"data": {"items": {"sku": [format!("SKU-{i}")]}}}),
            5 => json!({"subject": [{"prefix": format!("order/{i}/")}], "region": ["eu-west-1"]}),
            6 => json!({"tenant": [{"equals-ignore-case": format!("Tenant{i}")}]}),
            _ => json!({"data": {"status": [format!("S{i}")], "currency": ["EUR"]}}),
        })
        .collect()
}

fn index_of(patterns: &[Value]) -> RuleIndex {
    let mut b = RuleIndex::builder();
    for (i, p) in patterns.iter().enumerate() {
        b.add_pattern(i, &Pattern::compile(p).unwrap());
    }
    b.build()
}

fn matching(c: &mut Criterion) {
    let ev = event();
    let size = serde_json::to_vec(&ev).unwrap().len();
    assert!((1000..1400).contains(&size), "event is {size} bytes");
    let mut g = c.benchmark_group("match");
    g.throughput(Throughput::Elements(1));
    let mut out = Vec::new();

    let exact = json!({"type": ["com.example.order.created"]});
    let prefix = json!({"source": [{"prefix": "/orders/"}]});
    for (name, p) in [("exact", &exact), ("prefix", &prefix)] {
        let pattern = Pattern::compile(p).unwrap();
        g.bench_function(format!("pattern_1_{name}"), |b| {
            b.iter(|| black_box(pattern.matches(black_box(&ev))))
        });
        let idx = index_of(std::slice::from_ref(p));
        g.bench_function(format!("index_1_{name}"), |b| {
            b.iter(|| {
                idx.matches(black_box(&ev), &mut out);
                black_box(out.len())
            })
        });
    }
    // Same shape as the one-rule cases, 10 000 times: one of them matches.
    for (name, make) in [
        (
            "exact",
            (|i: usize| json!({"type": [format!("com.example.type{i}")]})) as fn(usize) -> Value,
        ),
        (
            "prefix",
            |i: usize| json!({"source": [{"prefix": format!("/svc{i}/")}]}),
        ),
    ] {
        let mut rs: Vec<Value> = (0..10_000).map(make).collect();
        rs[5_000] = if name == "exact" {
            exact.clone()
        } else {
            prefix.clone()
        };
        let idx = index_of(&rs);
        idx.matches(&ev, &mut out);
        assert_eq!(out, vec![5_000]);
        g.bench_function(format!("index_10000_{name}"), |b| {
            b.iter(|| {
                idx.matches(black_box(&ev), &mut out);
                black_box(out.len())
            })
        });
    }
    // A mix of shapes over ten fields (attributes, extensions, nested data, arrays,
    // numeric ranges, case folding); the event visits every one of those fields.
    for n in [1, 100, 10_000] {
        let mut rs = rules(n.max(2));
        rs.truncate(n);
        // Make sure some rules match, as on a real bus.
        rs[0] = exact.clone();
        if n > 1 {
            rs[1] = prefix.clone();
        }
        let idx = index_of(&rs);
        idx.matches(&ev, &mut out);
        assert!(!out.is_empty());
        g.bench_function(format!("index_{n}_mixed"), |b| {
            b.iter(|| {
                idx.matches(black_box(&ev), &mut out);
                black_box(out.len())
            })
        });
    }
    let filter =
        CesqlFilter::parse("type = 'com.example.order.created' AND region LIKE 'eu-%'").unwrap();
    g.bench_function("cesql_1", |b| {
        b.iter(|| black_box(filter.matches(black_box(&ev))))
    });
    g.finish();
}

fn transforms(c: &mut Criterion) {
    let ev = event();
    let mut g = c.benchmark_group("transform");
    g.throughput(Throughput::Elements(1));
    let chains = [
        (
            "jsonpath",
            json!({"form": "JSONPATH", "value": "$.data.customer"}),
        ),
        (
            "template_json",
            json!({"form": "TEMPLATE",
                   "value": {"id": "$.data.orderId", "total": "$.data.total", "who": "$.data.customer.email"},
                   "template": "{\"order\": ${id}, \"amount\": ${total}, \"text\": \"Order ${id} by ${who}\"}"}),
        ),
        (
            "map_data_and_attributes",
            json!([
                {"form": "MAP_DATA", "fields": {"order.id": "$.data.orderId", "order.total": "$.data.total", "tier": "$.data.customer.tier"}},
                {"form": "SET_ATTRIBUTES", "attributes": {"type": "com.example.order.summary"}}
            ]),
        ),
    ];
    for (name, spec) in chains {
        let chain = TransformChain::compile(&spec).unwrap();
        g.bench_function(name, |b| {
            b.iter(|| black_box(chain.apply(black_box(&ev)).unwrap()))
        });
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
}

criterion_group! {
    name = benches;
    config = config();
    targets = matching, transforms
}
criterion_main!(benches);
