//! Where the server behind a tool reports its progress on a call: the
//! `/mcp` client whose call it is. Carried on the invoke's context, the
//! host's own (no filter sees or sets it), to the terminal that calls the
//! server; a report past what the client has taken is dropped, so a server
//! that floods its reports holds back neither the call nor the client. A
//! report is its numbers only: the server's words would reach the client
//! without passing the token transforms, which every text shown does.

use std::fmt;

use tokio::sync::mpsc;

/// How many reports wait for the client at most.
const WAITING: usize = 64;

/// One report of a call's progress, as a server makes it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Report {
    /// The progress so far (it grows with each report).
    pub progress: f64,
    /// What the progress runs to, if known.
    pub total: Option<f64>,
}

/// Where a call's progress reports go.
#[derive(Clone)]
pub(crate) struct Progress(mpsc::Sender<Report>);

impl Progress {
    /// A place for reports, and where they arrive: it ends when every
    /// [`Progress`] of it is gone (the call's invoke has ended).
    pub(crate) fn channel() -> (Progress, mpsc::Receiver<Report>) {
        let (sender, reports) = mpsc::channel(WAITING);
        (Progress(sender), reports)
    }

    /// Passes `report` on, or drops it while [`WAITING`] wait already.
    pub(crate) fn report(&self, report: Report) {
        let _ = self.0.try_send(report);
    }
}

impl fmt::Debug for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Progress")
    }
}

#[cfg(test)]
mod tests {
    use super::{Progress, Report, WAITING};

    #[test]
    fn reports_past_what_waits_are_dropped_and_the_end_is_heard() {
        let (progress, mut reports) = Progress::channel();
        for n in 0..WAITING * 4 {
            progress.report(Report {
                progress: n as f64,
                total: None,
            });
        }
        drop(progress);
        let mut heard = Vec::new();
        while let Some(report) = reports.blocking_recv() {
            heard.push(report.progress);
        }
        let first: Vec<f64> = (0..WAITING).map(|n| n as f64).collect();
        assert_eq!(heard, first, "the first reports, in order, then the end");
    }
}
