//! Which queue a partition key goes to. Keys are spread over the topic's write queues as the
//! producer's route lists them (sorted, so every replica maps a key to the same queue): same
//! key, same queue, for as long as that list stays the same. The list is learnt from the
//! sends themselves (the client hands it to the queue selector), so a topic the broker has
//! not seen yet is spread over the queues of the default route, which is also what the
//! broker creates the topic with. When the list changes, keys move: the change is logged
//! once and every batch grouped under the old list is refused and grouped again.

use std::sync::Mutex;

use rocketmq_model::common::message::message_queue::MessageQueue;

/// The write queues keys are spread over, sorted by broker and queue id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct QueueMap {
    queues: Vec<MessageQueue>,
}

impl QueueMap {
    /// The map for the queues a route lists (in any order). `None` when it lists none.
    pub(super) fn new(route: &[MessageQueue]) -> Option<QueueMap> {
        let mut queues = route.to_vec();
        queues
            .sort_by(|a, b| (a.broker_name(), a.queue_id()).cmp(&(b.broker_name(), b.queue_id())));
        queues.dedup();
        (!queues.is_empty()).then_some(QueueMap { queues })
    }

    pub(super) fn len(&self) -> usize {
        self.queues.len()
    }

    /// The index of the queue `key` goes to (the same hash ingress uses to pick a shard).
    pub(super) fn index_of(&self, key: &str) -> usize {
        crate::event::shard_of(key, self.queues.len() as u32) as usize
    }

    pub(super) fn queue(&self, index: usize) -> Option<&MessageQueue> {
        self.queues.get(index)
    }

    /// `broker:queue` for every queue, for logs and errors.
    pub(super) fn describe(&self) -> String {
        let names: Vec<String> = self
            .queues
            .iter()
            .map(|q| format!("{}:{}", q.broker_name(), q.queue_id()))
            .collect();
        names.join(",")
    }
}

/// What one send saw of the route, compared with the map its batch was grouped under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Seen {
    /// The route lists the queues the batch was grouped for.
    Same,
    /// The first route the target sees.
    First,
    /// The route lists other queues than the batch was grouped for. `first_report` is true
    /// for the one send that tells the target, so the change is logged once however many
    /// batches trip on it.
    Changed {
        from: QueueMap,
        to: QueueMap,
        first_report: bool,
    },
}

/// The map a target currently groups its batches under, shared by its tasks.
#[derive(Debug, Default)]
pub(super) struct Route {
    current: Mutex<Option<QueueMap>>,
}

impl Route {
    pub(super) fn current(&self) -> Option<QueueMap> {
        self.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records the queues a send saw; `expected` is the map its batch was grouped under
    /// (`None` for the send that learns the route).
    pub(super) fn observe(&self, expected: Option<&QueueMap>, seen: &QueueMap) -> Seen {
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if expected == Some(seen) {
            return Seen::Same;
        }
        let Some(now) = current.clone() else {
            *current = Some(seen.clone());
            return Seen::First;
        };
        if expected.is_none() && now == *seen {
            return Seen::Same;
        }
        *current = Some(seen.clone());
        Seen::Changed {
            from: expected.cloned().unwrap_or_else(|| now.clone()),
            to: seen.clone(),
            first_report: now != *seen,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queues(broker: &str, n: i32) -> Vec<MessageQueue> {
        (0..n)
            .rev()
            .map(|i| MessageQueue::from_parts("T", broker, i))
            .collect()
    }

    #[test]
    fn a_key_maps_to_one_queue_whatever_order_the_route_lists_them_in() {
        let a = QueueMap::new(&queues("b", 4)).unwrap();
        let mut reversed = queues("b", 4);
        reversed.reverse();
        let b = QueueMap::new(&reversed).unwrap();
        assert_eq!(a, b);
        for key in ["a", "b", "c", "d", "e", "order-17"] {
            let i = a.index_of(key);
            assert_eq!(i, b.index_of(key));
            assert!(i < 4);
        }
        // The same spread ingress uses: keys a..e over 4 queues.
        let spread: Vec<usize> = ["a", "b", "c", "d", "e"]
            .iter()
            .map(|k| a.index_of(k))
            .collect();
        assert_eq!(spread, [0, 1, 2, 3, 0]);
        assert!(QueueMap::new(&[]).is_none());
    }

    #[test]
    fn the_first_route_is_learnt_and_a_change_is_reported_once() {
        let route = Route::default();
        let four = QueueMap::new(&queues("b", 4)).unwrap();
        let eight = QueueMap::new(&queues("b", 8)).unwrap();
        assert_eq!(route.observe(None, &four), Seen::First);
        assert_eq!(route.current(), Some(four.clone()));
        assert_eq!(
            route.observe(None, &four),
            Seen::Same,
            "learnt by another task"
        );
        assert_eq!(route.observe(Some(&four), &four), Seen::Same);
        let change = |first_report| Seen::Changed {
            from: four.clone(),
            to: eight.clone(),
            first_report,
        };
        assert_eq!(route.observe(Some(&four), &eight), change(true));
        assert_eq!(route.current(), Some(eight.clone()));
        // A batch grouped under the old map still trips on it, without a second report.
        assert_eq!(route.observe(Some(&four), &eight), change(false));
        assert_eq!(route.observe(Some(&eight), &eight), Seen::Same);
        // A route that lists another broker's queues too is a change.
        let mixed: Vec<MessageQueue> = queues("a", 2).into_iter().chain(queues("b", 8)).collect();
        let both = QueueMap::new(&mixed).unwrap();
        assert_eq!(both.len(), 10);
        assert!(matches!(
            route.observe(Some(&eight), &both),
            Seen::Changed {
                first_report: true,
                ..
            }
        ));
    }
}
