//! Five-field cron expressions (minute, hour, day of month, month, day of week) and the
//! slots they name in an IANA time zone. What is implemented: `*`, numbers, ranges
//! `a-b`, steps `*/n` and `a-b/n`, lists `a,b`; day of week 0-7 (0 and 7 are Sunday).
//! Names (`MON`, `JAN`), `@hourly` and the like, `L`, `W`, `#` and `?` are refused, not
//! guessed. As in the classic cron, when both day fields are restricted a day matches
//! either of them.
//!
//! Slots are civil times in the zone: a time that a clock change skips runs as if the
//! clock had not changed (02:30 on the night summer time starts is 03:30 summer time);
//! one that occurs twice runs at its first occurrence.

use chrono::{DateTime, TimeZone as _, Utc};

/// A parsed schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    minutes: u64,
    hours: u32,
    days: u32,
    months: u16,
    weekdays: u8,
    days_restricted: bool,
    weekdays_restricted: bool,
}

fn field(text: &str, name: &str, min: u32, max: u32) -> Result<(u64, bool), String> {
    let mut bits = 0u64;
    let restricted = text != "*";
    for part in text.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((r, s)) => {
                let step: u32 =
                    s.parse().ok().filter(|s| *s > 0).ok_or_else(|| {
                        format!("{name}: `{s}` is not a step (a positive number)")
                    })?;
                (r, step)
            }
            None => (part, 1),
        };
        let number = |s: &str| -> Result<u32, String> {
            let n: u32 = s.parse().map_err(|_| {
                format!(
                    "{name}: `{s}` is not a number (names and special characters are not supported)"
                )
            })?;
            if n < min || n > max {
                return Err(format!("{name}: {n} is outside {min}-{max}"));
            }
            Ok(n)
        };
        let (lo, hi) = if range == "*" {
            (min, max)
        } else if let Some((a, b)) = range.split_once('-') {
            let (a, b) = (number(a)?, number(b)?);
            if a > b {
                return Err(format!("{name}: the range {a}-{b} is backwards"));
            }
            (a, b)
        } else {
            let a = number(range)?;
            // `5/15` means from 5 to the end, every 15.
            (a, if step > 1 { max } else { a })
        };
        let mut n = lo;
        while n <= hi {
            bits |= 1 << n;
            n += step;
        }
    }
    Ok((bits, restricted))
}

impl Schedule {
    pub fn parse(text: &str) -> Result<Self, String> {
        let fields: Vec<&str> = text.split_whitespace().collect();
        if fields.len() != 5 {
            return Err(
                "a schedule has five fields: minute hour day-of-month month day-of-week".to_owned(),
            );
        }
        let (minutes, _) = field(fields[0], "minute", 0, 59)?;
        let (hours, _) = field(fields[1], "hour", 0, 23)?;
        let (days, days_restricted) = field(fields[2], "day of month", 1, 31)?;
        let (months, _) = field(fields[3], "month", 1, 12)?;
        let (mut weekdays, weekdays_restricted) = field(fields[4], "day of week", 0, 7)?;
        if weekdays & (1 << 7) != 0 {
            weekdays |= 1;
        }
        Ok(Self {
            minutes,
            hours: hours as u32,
            days: days as u32,
            months: months as u16,
            weekdays: (weekdays & 0x7f) as u8,
            days_restricted,
            weekdays_restricted,
        })
    }

    fn day_matches(&self, y: i16, m: i8, d: i8) -> bool {
        let dom = self.days & (1 << d) != 0;
        let wd = jiff::civil::date(y, m, d).weekday().to_sunday_zero_offset();
        let dow = self.weekdays & (1 << wd) != 0;
        match (self.days_restricted, self.weekdays_restricted) {
            (true, true) => dom || dow,
            _ => dom && dow,
        }
    }

    /// The latest slot at or before `at`, within five years.
    pub fn latest_at_or_before(
        &self,
        tz: &jiff::tz::TimeZone,
        at: DateTime<Utc>,
    ) -> Option<DateTime<Utc>> {
        let mut c = Civil::of(tz, at)?;
        let floor = c.y - 5;
        while c.y >= floor {
            if self.months & (1 << c.m) == 0 {
                c = c.end_of_previous_month();
            } else if !self.day_matches(c.y, c.m, c.d) {
                c = c.end_of_previous_day();
            } else if self.hours & (1 << c.h) == 0 {
                c = c.end_of_previous_hour();
            } else if self.minutes & (1 << c.min) == 0 {
                c = c.previous_minute();
            } else {
                let t = c.instant(tz)?;
                if t <= at {
                    return Some(t);
                }
                // A civil time moved past `at` by a gap: keep looking earlier.
                c = c.previous_minute();
            }
        }
        None
    }

    /// The first slot after `at`, within five years.
    pub fn next_after(&self, tz: &jiff::tz::TimeZone, at: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let mut c = Civil::of(tz, at)?.next_minute();
        let ceiling = c.y + 5;
        while c.y <= ceiling {
            if self.months & (1 << c.m) == 0 {
                c = c.start_of_next_month();
            } else if !self.day_matches(c.y, c.m, c.d) {
                c = c.start_of_next_day();
            } else if self.hours & (1 << c.h) == 0 {
                c = c.start_of_next_hour();
            } else if self.minutes & (1 << c.min) == 0 {
                c = c.next_minute();
            } else {
                let t = c.instant(tz)?;
                if t > at {
                    return Some(t);
                }
                c = c.next_minute();
            }
        }
        None
    }
}

/// The time zone named `name` (IANA), from the system's zoneinfo.
pub fn time_zone(name: &str) -> Result<jiff::tz::TimeZone, String> {
    jiff::tz::TimeZone::get(name).map_err(|_| {
        format!(
            "`{name}` is not a time zone this server knows (an IANA name such as Europe/Berlin)"
        )
    })
}

/// A civil time to the minute.
#[derive(Debug, Clone, Copy)]
struct Civil {
    y: i16,
    m: i8,
    d: i8,
    h: i8,
    min: i8,
}

fn days_in(y: i16, m: i8) -> i8 {
    jiff::civil::date(y, m, 1).days_in_month()
}

impl Civil {
    fn of(tz: &jiff::tz::TimeZone, at: DateTime<Utc>) -> Option<Self> {
        let ts = jiff::Timestamp::from_second(at.timestamp()).ok()?;
        let dt = ts.to_zoned_datetime(tz.clone()).datetime();
        Some(Self {
            y: dt.year(),
            m: dt.month(),
            d: dt.day(),
            h: dt.hour(),
            min: dt.minute(),
        })
    }

    fn instant(self, tz: &jiff::tz::TimeZone) -> Option<DateTime<Utc>> {
        let z = jiff::civil::date(self.y, self.m, self.d)
            .at(self.h, self.min, 0, 0)
            .to_zoned_datetime(tz.clone())
            .ok()?;
        Utc.timestamp_opt(z.timestamp().as_second(), 0).single()
    }

    fn previous_minute(self) -> Self {
        if self.min > 0 {
            Self {
                min: self.min - 1,
                ..self
            }
        } else {
            self.end_of_previous_hour()
        }
    }

    fn end_of_previous_hour(self) -> Self {
        if self.h > 0 {
            Self {
                h: self.h - 1,
                min: 59,
                ..self
            }
        } else {
            self.end_of_previous_day()
        }
    }

    fn end_of_previous_day(self) -> Self {
        if self.d > 1 {
            Self {
                d: self.d - 1,
                h: 23,
                min: 59,
                ..self
            }
        } else {
            self.end_of_previous_month()
        }
    }

    fn end_of_previous_month(self) -> Self {
        let (y, m) = if self.m > 1 {
            (self.y, self.m - 1)
        } else {
            (self.y - 1, 12)
        };
        Self {
            y,
            m,
            d: days_in(y, m),
            h: 23,
            min: 59,
        }
    }

    fn next_minute(self) -> Self {
        if self.min < 59 {
            Self {
                min: self.min + 1,
                ..self
            }
        } else {
            self.start_of_next_hour()
        }
    }

    fn start_of_next_hour(self) -> Self {
        if self.h < 23 {
            Self {
                h: self.h + 1,
                min: 0,
                ..self
            }
        } else {
            self.start_of_next_day()
        }
    }

    fn start_of_next_day(self) -> Self {
        if self.d < days_in(self.y, self.m) {
            Self {
                d: self.d + 1,
                h: 0,
                min: 0,
                ..self
            }
        } else {
            self.start_of_next_month()
        }
    }

    fn start_of_next_month(self) -> Self {
        let (y, m) = if self.m < 12 {
            (self.y, self.m + 1)
        } else {
            (self.y + 1, 1)
        };
        Self {
            y,
            m,
            d: 1,
            h: 0,
            min: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn utc(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    #[test]
    fn fields_are_parsed_and_what_is_not_implemented_is_refused() {
        assert!(Schedule::parse("* * * * *").is_ok());
        assert!(Schedule::parse("*/15 9-17 * * 1-5").is_ok());
        assert!(Schedule::parse("0 3 1,15 * 7").is_ok());
        for bad in [
            "* * * *",
            "@hourly",
            "0 0 * * MON",
            "0 0 * JAN *",
            "60 * * * *",
            "* 24 * * *",
            "* * 0 * *",
            "* * * * 8",
            "5-1 * * * *",
            "*/0 * * * *",
            "0 0 L * *",
            "0 0 ? * *",
        ] {
            assert!(Schedule::parse(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn slots_are_found_before_and_after_an_instant() {
        let utc_tz = time_zone("UTC").unwrap();
        let every_minute = Schedule::parse("* * * * *").unwrap();
        assert_eq!(
            every_minute.latest_at_or_before(&utc_tz, utc("2030-01-01T12:01:30Z")),
            Some(utc("2030-01-01T12:01:00Z"))
        );
        assert_eq!(
            every_minute.next_after(&utc_tz, utc("2030-01-01T12:01:00Z")),
            Some(utc("2030-01-01T12:02:00Z"))
        );
        let weekdays_at_nine = Schedule::parse("0 9 * * 1-5").unwrap();
        // 2030-01-05 is a Saturday: the latest slot is Friday's.
        assert_eq!(
            weekdays_at_nine.latest_at_or_before(&utc_tz, utc("2030-01-05T12:00:00Z")),
            Some(utc("2030-01-04T09:00:00Z"))
        );
        assert_eq!(
            weekdays_at_nine.next_after(&utc_tz, utc("2030-01-05T12:00:00Z")),
            Some(utc("2030-01-07T09:00:00Z"))
        );
        // Either day field matches when both are restricted.
        let first_or_sunday = Schedule::parse("0 0 1 * 0").unwrap();
        assert_eq!(
            first_or_sunday.next_after(&utc_tz, utc("2030-01-01T00:00:00Z")),
            Some(utc("2030-01-06T00:00:00Z"))
        );
        let leap = Schedule::parse("0 0 29 2 *").unwrap();
        assert_eq!(
            leap.next_after(&utc_tz, utc("2030-01-01T00:00:00Z")),
            Some(utc("2032-02-29T00:00:00Z"))
        );
    }

    #[test]
    fn slots_follow_the_time_zone() {
        let berlin = time_zone("Europe/Berlin").unwrap();
        let nine = Schedule::parse("0 9 * * *").unwrap();
        // Winter: UTC+1; summer: UTC+2.
        assert_eq!(
            nine.next_after(&berlin, utc("2030-01-10T00:00:00Z")),
            Some(utc("2030-01-10T08:00:00Z"))
        );
        assert_eq!(
            nine.next_after(&berlin, utc("2030-07-10T00:00:00Z")),
            Some(utc("2030-07-10T07:00:00Z"))
        );
        // 02:30 does not exist on 2030-03-31 in Berlin: it runs at 03:00 local.
        let half_past_two = Schedule::parse("30 2 * * *").unwrap();
        assert_eq!(
            half_past_two.next_after(&berlin, utc("2030-03-30T12:00:00Z")),
            Some(utc("2030-03-31T01:30:00Z"))
        );
        assert!(time_zone("Mars/Olympus").is_err());
    }
}
