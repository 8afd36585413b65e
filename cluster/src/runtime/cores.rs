//! Core lists (`0-15`, `0,2,4-7`) and pinning the process to them, so the
//! compute threads a worker starts afterwards (experts, attention) run only there.

use anyhow::{Result, bail};

/// Parses a core list such as `0-3,8,10-11`.
pub fn parse_cores(spec: &str) -> Result<Vec<usize>> {
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) else {
            bail!("invalid core list '{spec}': '{part}' is not N or N-M");
        };
        if a > b {
            bail!("invalid core list '{spec}': range {a}-{b} is reversed");
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    if out.is_empty() {
        bail!("invalid core list '{spec}': no cores");
    }
    Ok(out)
}

/// Restricts the whole process (and threads it starts later) to `cores`.
pub fn pin_process(cores: &[usize]) -> Result<()> {
    // SAFETY: cpu_set_t is plain data; CPU_ZERO/CPU_SET write within it for
    // core ids below CPU_SETSIZE (checked), and sched_setaffinity(0, ...) only
    // reads the set for the calling thread, inherited by threads created later.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        for &c in cores {
            if c >= libc::CPU_SETSIZE as usize {
                bail!("core {c} is beyond what this system can address");
            }
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            bail!(
                "cannot pin to cores {cores:?}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_cores;

    #[test]
    fn core_lists() {
        assert_eq!(parse_cores("0-3").ok(), Some(vec![0, 1, 2, 3]));
        assert_eq!(parse_cores("4,0-1,1").ok(), Some(vec![0, 1, 4]));
        assert!(parse_cores("3-1").is_err());
        assert!(parse_cores("a").is_err());
        assert!(parse_cores("").is_err());
    }
}
