//! When each request is sent: all at once for an infinite rate, else gaps drawn
//! from a gamma distribution (shape = burstiness, mean = 1/rate; burstiness 1 is
//! a Poisson process), seeded, then scaled so the last request goes out at
//! exactly n/rate seconds, as vLLM does to steady throughput across seeds.

use anyhow::{Result, bail};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Gamma};

/// Send times of `n` requests, in seconds from the start of the run.
pub fn arrival_offsets(n: usize, rate: f64, burstiness: f64, seed: u64) -> Result<Vec<f64>> {
    if rate.is_nan() || rate <= 0.0 {
        bail!("--request-rate must be positive, got {rate}");
    }
    if burstiness.is_nan() || burstiness <= 0.0 {
        bail!("--burstiness must be positive, got {burstiness}");
    }
    if rate.is_infinite() {
        return Ok(vec![0.0; n]);
    }
    let mut gaps: Vec<f64> = if burstiness.is_infinite() {
        vec![1.0 / rate; n]
    } else {
        let gamma = Gamma::new(burstiness, 1.0 / (rate * burstiness)).map_err(|e| {
            anyhow::anyhow!("gamma distribution for rate {rate}, burstiness {burstiness}: {e}")
        })?;
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n).map(|_| gamma.sample(&mut rng)).collect()
    };
    for i in 1..gaps.len() {
        gaps[i] += gaps[i - 1];
    }
    let last = gaps.last().copied().unwrap_or(0.0);
    if last > 0.0 {
        let scale = (n as f64 / rate) / last;
        for g in &mut gaps {
            *g *= scale;
        }
    }
    Ok(gaps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn infinite_rate_sends_everything_at_once() {
        assert_eq!(
            arrival_offsets(3, f64::INFINITY, 1.0, 0).expect("offsets"),
            vec![0.0; 3]
        );
    }

    #[test]
    fn poisson_arrivals_end_at_n_over_rate() {
        let t = arrival_offsets(200, 4.0, 1.0, 7).expect("offsets");
        assert_eq!(t.len(), 200);
        assert!(t.windows(2).all(|w| w[0] <= w[1]));
        assert!((t[199] - 50.0).abs() < 1e-9);
        // Exponential gaps vary; the same seed gives the same times.
        let gaps: Vec<f64> = t.windows(2).map(|w| w[1] - w[0]).collect();
        let max = gaps.iter().cloned().fold(0.0, f64::max);
        assert!(max > 0.5, "max gap {max}");
        assert_eq!(t, arrival_offsets(200, 4.0, 1.0, 7).expect("offsets"));
        assert_ne!(t, arrival_offsets(200, 4.0, 1.0, 8).expect("offsets"));
    }

    #[test]
    fn infinite_burstiness_is_uniform() {
        let t = arrival_offsets(4, 2.0, f64::INFINITY, 0).expect("offsets");
        assert_eq!(t, vec![0.5, 1.0, 1.5, 2.0]);
        assert!(arrival_offsets(4, 2.0, 0.0, 0).is_err());
        assert!(arrival_offsets(4, 0.0, 1.0, 0).is_err());
    }
}
