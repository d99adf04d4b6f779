//! Reading Server-Sent Events: an incremental parser that takes the bytes of a
//! `text/event-stream` body as they arrive and gives back the events it completes, by the
//! WHATWG HTML "event stream interpretation" rules. The client commands, the bench and the
//! OpenCode adapter all read event streams through it.
//!
//! What the rules say, and this parser does:
//! - lines end with CRLF, LF or a lone CR (a CRLF split across two chunks is one end);
//! - one leading byte-order mark is dropped; bytes that are not UTF-8 become U+FFFD;
//! - a line starting with `:` is a comment; a line without a colon is a field with an
//!   empty value; one space after the colon is not part of the value;
//! - `data` lines are joined with `\n`; `event` sets the type (`message` when unset);
//!   `id` sets the last event id, which carries over to later events, unless its value
//!   holds a NUL; `retry` sets the reconnection time when it is all ASCII digits;
//!   unknown fields are ignored;
//! - a blank line dispatches the event; an event with no `data` field is not dispatched
//!   (its `event` is forgotten, its `id` kept); an event cut off by the end of the
//!   stream is never dispatched.

use std::time::Duration;

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The last event id at dispatch (empty when none was set).
    pub id: String,
    /// The event type: the `event` field, or `message`.
    pub event: String,
    /// The `data` lines, joined by `\n`.
    pub data: String,
}

const BOM: &[u8] = b"\xEF\xBB\xBF";

/// The parser's state between chunks. Feed it with [`Parser::push`].
#[derive(Debug, Default)]
pub struct Parser {
    /// The bytes of a line not yet ended.
    line: Vec<u8>,
    /// The first bytes of the stream while they may still be a byte-order mark.
    start: Vec<u8>,
    /// Whether the stream's start (and its byte-order mark, if any) is behind us.
    started: bool,
    /// The previous chunk ended with CR: a LF opening this one belongs to it.
    after_cr: bool,
    data: String,
    /// Whether a `data` field was seen for the event being built.
    has_data: bool,
    event: String,
    last_id: String,
    retry: Option<Duration>,
}

impl Parser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Parse the next bytes of the stream; returns the events they complete, in order.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<Event> {
        let mut out = Vec::new();
        self.push_into(bytes, &mut out);
        out
    }

    /// Like [`Parser::push`], appending to `out`.
    pub fn push_into(&mut self, mut bytes: &[u8], out: &mut Vec<Event>) {
        if !self.started {
            let wanted = BOM.len() - self.start.len();
            let take = wanted.min(bytes.len());
            self.start.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.start.len() < BOM.len() && BOM.starts_with(&self.start) {
                // Could still be a byte-order mark; wait for more.
                return;
            }
            self.started = true;
            let start = std::mem::take(&mut self.start);
            if start != BOM {
                self.scan(&start, out);
            }
        }
        self.scan(bytes, out);
    }

    /// The reconnection time the stream asked for with `retry`, if any.
    pub fn retry(&self) -> Option<Duration> {
        self.retry
    }

    /// The last event id seen so far (what a reconnect sends as `Last-Event-ID`).
    pub fn last_event_id(&self) -> &str {
        &self.last_id
    }

    /// Bytes held for the event not yet complete: a reader that must bound its memory
    /// checks this after each push.
    pub fn pending(&self) -> usize {
        self.line.len() + self.data.len() + self.event.len()
    }

    fn scan(&mut self, mut bytes: &[u8], out: &mut Vec<Event>) {
        if self.after_cr && !bytes.is_empty() {
            self.after_cr = false;
            if bytes[0] == b'\n' {
                bytes = &bytes[1..];
            }
        }
        while let Some(end) = bytes.iter().position(|b| *b == b'\n' || *b == b'\r') {
            let line = &bytes[..end];
            let mut next = end + 1;
            if bytes[end] == b'\r' {
                match bytes.get(next) {
                    Some(b'\n') => next += 1,
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
            if self.line.is_empty() {
                self.line_ended(line, out);
            } else {
                let mut whole = std::mem::take(&mut self.line);
                whole.extend_from_slice(line);
                self.line_ended(&whole, out);
                whole.clear();
                // Keep the allocation for the next long line.
                self.line = whole;
            }
            bytes = &bytes[next..];
        }
        self.line.extend_from_slice(bytes);
    }

    fn line_ended(&mut self, line: &[u8], out: &mut Vec<Event>) {
        if line.is_empty() {
            self.dispatch(out);
            return;
        }
        if line[0] == b':' {
            return;
        }
        let (field, value) = match line.iter().position(|b| *b == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &b""[..]),
        };
        match field {
            b"data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.has_data = true;
                self.data.push_str(&String::from_utf8_lossy(value));
            }
            b"event" => self.event = String::from_utf8_lossy(value).into_owned(),
            b"id" if !value.contains(&0) => {
                self.last_id = String::from_utf8_lossy(value).into_owned();
            }
            // All digits, so it parses unless it overflows (then it is ignored too).
            b"retry" if !value.is_empty() && value.iter().all(u8::is_ascii_digit) => {
                if let Ok(ms) = std::str::from_utf8(value).unwrap_or("").parse::<u64>() {
                    self.retry = Some(Duration::from_millis(ms));
                }
            }
            _ => {}
        }
    }

    fn dispatch(&mut self, out: &mut Vec<Event>) {
        let event = std::mem::take(&mut self.event);
        if !self.has_data {
            return;
        }
        self.has_data = false;
        out.push(Event {
            id: self.last_id.clone(),
            event: if event.is_empty() {
                "message".to_owned()
            } else {
                event
            },
            data: std::mem::take(&mut self.data),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(id: &str, event: &str, data: &str) -> Event {
        Event {
            id: id.to_owned(),
            event: event.to_owned(),
            data: data.to_owned(),
        }
    }

    fn parse(stream: &[u8]) -> Vec<Event> {
        Parser::new().push(stream)
    }

    /// The same stream fed in every split into two chunks, and byte by byte, gives the
    /// same events as fed whole.
    fn parse_in_pieces(stream: &[u8]) -> Vec<Event> {
        let whole = parse(stream);
        for cut in 0..=stream.len() {
            let mut p = Parser::new();
            let mut got = p.push(&stream[..cut]);
            got.extend(p.push(&stream[cut..]));
            assert_eq!(got, whole, "split at {cut} of {stream:?}");
        }
        let mut p = Parser::new();
        let got: Vec<Event> = stream.iter().flat_map(|b| p.push(&[*b])).collect();
        assert_eq!(got, whole, "byte by byte: {stream:?}");
        whole
    }

    #[test]
    fn the_servers_own_framing_reads_back() {
        let got = parse_in_pieces(
            b"retry: 3000\n\nid: 1\nevent: status\ndata: {\"seq\":1}\n\n: ping\n\nid: 2\nevent: x\ndata: {\"seq\":2}\n\n",
        );
        assert_eq!(
            got,
            [
                ev("1", "status", "{\"seq\":1}"),
                ev("2", "x", "{\"seq\":2}")
            ]
        );
    }

    #[test]
    fn lf_crlf_and_lone_cr_all_end_lines_even_mixed() {
        for stream in [
            &b"data: a\n\ndata: b\n\n"[..],
            b"data: a\r\n\r\ndata: b\r\n\r\n",
            b"data: a\r\rdata: b\r\r",
            b"data: a\r\n\rdata: b\n\r\n",
        ] {
            assert_eq!(
                parse_in_pieces(stream),
                [ev("", "message", "a"), ev("", "message", "b")],
                "{stream:?}"
            );
        }
    }

    #[test]
    fn a_cr_then_lf_in_the_next_chunk_is_one_line_end() {
        let mut p = Parser::new();
        assert!(p.push(b"data: a\r").is_empty());
        // Were the LF a second line end, this would dispatch `a` with an empty line.
        assert!(p.push(b"\ndata: b\r").is_empty());
        assert_eq!(p.push(b"\n\r\n"), [ev("", "message", "a\nb")]);
    }

    #[test]
    fn data_lines_are_joined_with_lf() {
        assert_eq!(
            parse_in_pieces(b"data: one\ndata:two\ndata\ndata:  four\n\n"),
            [ev("", "message", "one\ntwo\n\n four")]
        );
    }

    #[test]
    fn an_empty_data_field_still_dispatches_an_event_with_empty_data() {
        assert_eq!(parse(b"data\n\n"), [ev("", "message", "")]);
        assert_eq!(parse(b"data:\n\n"), [ev("", "message", "")]);
        assert_eq!(parse(b"data\ndata\n\n"), [ev("", "message", "\n")]);
    }

    #[test]
    fn an_event_without_data_is_not_dispatched_and_its_type_is_forgotten() {
        assert_eq!(
            parse_in_pieces(b"event: lonely\nid: 7\n\ndata: x\n\n"),
            [ev("7", "message", "x")]
        );
    }

    #[test]
    fn comments_are_ignored_wherever_they_stand() {
        assert_eq!(
            parse_in_pieces(b": hello\ndata: a\n: between\ndata: b\n:\n\n"),
            [ev("", "message", "a\nb")]
        );
    }

    #[test]
    fn only_one_space_after_the_colon_is_dropped() {
        assert_eq!(
            parse(b"event:  spaced\ndata:\tx \n\n"),
            [ev("", " spaced", "\tx ")]
        );
    }

    #[test]
    fn a_field_without_a_colon_has_an_empty_value() {
        // `event` with no value resets the type to the default.
        assert_eq!(
            parse(b"event: a\nevent\ndata: x\n\n"),
            [ev("", "message", "x")]
        );
        // `id` with no value clears the last event id.
        assert_eq!(
            parse(b"id: 3\ndata: x\n\nid\ndata: y\n\n"),
            [ev("3", "message", "x"), ev("", "message", "y")]
        );
    }

    #[test]
    fn unknown_fields_and_case_variants_are_ignored() {
        assert_eq!(
            parse(b"Data: no\nfoo: bar\ndata: yes\nEVENT: no\n\n"),
            [ev("", "message", "yes")]
        );
    }

    #[test]
    fn the_last_event_id_carries_over_to_later_events() {
        let mut p = Parser::new();
        let got = p.push(b"id: 5\ndata: a\n\ndata: b\n\nid: 6\n\n");
        assert_eq!(got, [ev("5", "message", "a"), ev("5", "message", "b")]);
        // An id with no data dispatches nothing but still counts for a reconnect.
        assert_eq!(p.last_event_id(), "6");
    }

    #[test]
    fn an_id_holding_nul_is_ignored() {
        assert_eq!(
            parse(b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n"),
            [ev("1", "message", "a"), ev("1", "message", "b")]
        );
    }

    #[test]
    fn retry_counts_only_when_all_digits() {
        let mut p = Parser::new();
        assert_eq!(p.retry(), None);
        p.push(b"retry: 3000\n");
        assert_eq!(p.retry(), Some(Duration::from_millis(3000)));
        for bad in [
            &b"retry: 12a\n"[..],
            b"retry: -5\n",
            b"retry:\n",
            b"retry\n",
            b"retry:  40\n",
            b"retry: 99999999999999999999999\n",
        ] {
            p.push(bad);
            assert_eq!(p.retry(), Some(Duration::from_millis(3000)), "{bad:?}");
        }
        // A retry alone is not an event.
        assert!(p.push(b"\n").is_empty());
        p.push(b"retry:0\n");
        assert_eq!(p.retry(), Some(Duration::ZERO));
    }

    #[test]
    fn one_leading_bom_is_dropped_and_only_at_the_start() {
        assert_eq!(
            parse_in_pieces(b"\xEF\xBB\xBFdata: a\n\n"),
            [ev("", "message", "a")]
        );
        // A second mark is part of the first line: a field named "\u{feff}data".
        assert!(parse(b"\xEF\xBB\xBF\xEF\xBB\xBFdata: a\n\n").is_empty());
        // Bytes held while the start might be a mark still count: here they are a
        // first line of their own, which names no known field.
        assert_eq!(
            parse_in_pieces(b"\xEF\xBB\ndata: a\n\n"),
            [ev("", "message", "a")]
        );
        assert!(parse_in_pieces(b"\n").is_empty());
    }

    #[test]
    fn invalid_utf8_becomes_replacement_characters_and_split_characters_survive() {
        assert_eq!(
            parse(b"data: a\xFFb\n\n"),
            [ev("", "message", "a\u{FFFD}b")]
        );
        assert_eq!(
            parse_in_pieces("data: é✓\n\n".as_bytes()),
            [ev("", "message", "é✓")]
        );
    }

    #[test]
    fn an_event_cut_off_by_the_end_of_the_stream_is_not_dispatched() {
        let mut p = Parser::new();
        assert_eq!(
            p.push(b"data: complete\n\ndata: cut"),
            [ev("", "message", "complete")]
        );
        assert!(p.push(b"\n").is_empty());
        assert_eq!(p.pending(), "cut".len());
    }
}
