use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::*;

impl Executor {
    /// Extends the leases of every call this relay runs, until cancelled.
    pub async fn keep_leases(self: Arc<Self>, shutdown: CancellationToken) {
        let every = self.lease / 3;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let ids = self.local_ids();
            match self.control.get().await {
                Ok(client) => {
                    if let Err(e) = crate::execute::claim::extend_leases(
                        &**client,
                        &self.owner,
                        &ids,
                        self.lease.as_secs_f64(),
                    )
                    .await
                    {
                        tracing::warn!(error = %e, "cannot extend leases");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot extend leases"),
            }
        }
    }
}
