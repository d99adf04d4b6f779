//! Line framing for a child's stdout: lines end at `\n` only (never at a lone `\r` or at
//! U+2028, which JSON may carry inside strings), and a line too long to hold is skipped
//! and reported rather than buffered without bound.

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

/// Longest line kept by default: 8 MiB.
pub const DEFAULT_MAX_LINE: usize = 8 * 1024 * 1024;

const READ_BUFFER: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum FramingError {
    /// A line longer than the limit was skipped; reading can go on with the next line.
    #[error("line of {len} bytes exceeds the limit and was skipped")]
    LineTooLong { len: usize },
    #[error("read error: {0}")]
    Io(#[from] std::io::Error),
}

/// Reads `\n`-terminated lines from `R`, without the `\n` and one trailing `\r`.
///
/// A line whose length (before removing a trailing `\r`) exceeds the limit is
/// discarded up to its `\n` and reported as [`FramingError::LineTooLong`]; the next call
/// returns the line after it. A last line without a final `\n` is returned at end of
/// input. `next_line` is cancel-safe: dropping its future loses no data.
pub struct LineReader<R> {
    inner: BufReader<R>,
    max: usize,
    line: Vec<u8>,
    /// Bytes seen so far of a line being skipped for its length.
    skipping: Option<usize>,
}

impl<R: AsyncRead + Unpin> LineReader<R> {
    pub fn new(reader: R) -> Self {
        Self::with_max(reader, DEFAULT_MAX_LINE)
    }

    pub fn with_max(reader: R, max: usize) -> Self {
        Self {
            inner: BufReader::with_capacity(READ_BUFFER, reader),
            max,
            line: Vec::new(),
            skipping: None,
        }
    }

    pub fn max_line(&self) -> usize {
        self.max
    }

    pub fn get_ref(&self) -> &R {
        self.inner.get_ref()
    }

    /// The next line, `Ok(None)` at end of input.
    pub async fn next_line(&mut self) -> Result<Option<Vec<u8>>, FramingError> {
        loop {
            let available = self.inner.fill_buf().await?;
            if available.is_empty() {
                if let Some(len) = self.skipping.take() {
                    return Err(FramingError::LineTooLong { len });
                }
                if self.line.is_empty() {
                    return Ok(None);
                }
                return Ok(Some(self.finish_line()));
            }

            match available.iter().position(|&b| b == b'\n') {
                Some(end) => {
                    let outcome = if let Some(seen) = self.skipping.take() {
                        Err(FramingError::LineTooLong { len: seen + end })
                    } else if self.line.len() + end > self.max {
                        let len = self.line.len() + end;
                        self.line = Vec::new();
                        Err(FramingError::LineTooLong { len })
                    } else {
                        self.line.extend_from_slice(&available[..end]);
                        Ok(Some(self.finish_line()))
                    };
                    self.inner.consume(end + 1);
                    return outcome;
                }
                None => {
                    let n = available.len();
                    if let Some(seen) = self.skipping.as_mut() {
                        *seen += n;
                    } else if self.line.len() + n > self.max {
                        self.skipping = Some(self.line.len() + n);
                        self.line = Vec::new();
                    } else {
                        self.line.extend_from_slice(available);
                    }
                    self.inner.consume(n);
                }
            }
        }
    }

    fn finish_line(&mut self) -> Vec<u8> {
        let mut line = std::mem::take(&mut self.line);
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::io::AsyncWriteExt;

    async fn collect(input: &[u8], max: usize) -> Vec<Result<Vec<u8>, usize>> {
        let mut reader = LineReader::with_max(input, max);
        let mut out = Vec::new();
        loop {
            match reader.next_line().await {
                Ok(Some(line)) => out.push(Ok(line)),
                Ok(None) => return out,
                Err(FramingError::LineTooLong { len }) => out.push(Err(len)),
                Err(FramingError::Io(e)) => panic!("io error: {e}"),
            }
        }
    }

    fn ok(s: &str) -> Result<Vec<u8>, usize> {
        Ok(s.as_bytes().to_vec())
    }

    #[tokio::test]
    async fn splits_on_newline_only() {
        let input = "a\rb\nc\u{2028}d\n\ne\r\n".as_bytes();
        assert_eq!(
            collect(input, 100).await,
            vec![ok("a\rb"), ok("c\u{2028}d"), ok(""), ok("e")]
        );
    }

    #[tokio::test]
    async fn strips_only_one_trailing_cr() {
        assert_eq!(collect(b"x\r\r\n\r\n", 100).await, vec![ok("x\r"), ok("")]);
    }

    #[tokio::test]
    async fn last_line_without_newline() {
        assert_eq!(collect(b"one\ntwo", 100).await, vec![ok("one"), ok("two")]);
        assert_eq!(
            collect(b"one\ntwo\r", 100).await,
            vec![ok("one"), ok("two")]
        );
        assert_eq!(collect(b"", 100).await, vec![]);
        assert_eq!(collect(b"\n", 100).await, vec![ok("")]);
    }

    #[tokio::test]
    async fn long_line_is_skipped_and_reading_continues() {
        let input = b"short\n0123456789ab\nnext\n";
        assert_eq!(
            collect(input, 10).await,
            vec![ok("short"), Err(12), ok("next")]
        );
    }

    #[tokio::test]
    async fn limit_is_inclusive() {
        assert_eq!(collect(b"0123456789\n", 10).await, vec![ok("0123456789")]);
        assert_eq!(collect(b"0123456789A\n", 10).await, vec![Err(11)]);
    }

    #[tokio::test]
    async fn long_last_line_without_newline() {
        assert_eq!(
            collect(b"ok\n0123456789abc", 10).await,
            vec![ok("ok"), Err(13)]
        );
    }

    #[tokio::test]
    async fn long_line_across_many_reads() {
        // Larger than the read buffer, delivered in small pieces.
        let (mut tx, rx) = tokio::io::duplex(1000);
        let writer = tokio::spawn(async move {
            tx.write_all(b"first\n").await.unwrap();
            let chunk = vec![b'x'; 1000];
            for _ in 0..200 {
                tx.write_all(&chunk).await.unwrap();
            }
            tx.write_all(b"\r\nafter\n").await.unwrap();
            tx.write_all(&vec![b'y'; 150_000]).await.unwrap();
            tx.write_all(b"\n").await.unwrap();
        });
        let mut reader = LineReader::with_max(rx, 150_000);
        assert_eq!(reader.next_line().await.unwrap().unwrap(), b"first");
        match reader.next_line().await {
            Err(FramingError::LineTooLong { len }) => assert_eq!(len, 200_001),
            other => panic!("expected LineTooLong, got {other:?}"),
        }
        assert_eq!(reader.next_line().await.unwrap().unwrap(), b"after");
        let big = reader.next_line().await.unwrap().unwrap();
        assert_eq!(big.len(), 150_000);
        assert!(big.iter().all(|&b| b == b'y'));
        writer.await.unwrap();
        assert!(reader.next_line().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn default_limit() {
        let reader = LineReader::new(&b""[..]);
        assert_eq!(reader.max_line(), DEFAULT_MAX_LINE);
    }
}
