//! Bit flips: a writer opening a damaged file refuses it or answers exactly as before, never
//! panics and never answers wrongly.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};

use common::backend::Disk;
use common::{Conversations, Rng};
use superfluid_warm::{Error, Hit, Warm};

#[test]
fn a_thousand_single_bit_flips_are_refused_or_harmless() -> Result<(), Error> {
    let disk = Disk::default();
    let mut rng = Rng(99);
    let mut conversations = Conversations::new(12);
    let mut prompts = Vec::new();
    {
        let warm = Warm::builder().open_with_backend(disk.backend())?;
        for i in 0..60 {
            let (m, p) = conversations.turn(&mut rng);
            warm.ran(m, &p, ["a", "b", "c"][i % 3])?;
            prompts.push((m, p));
        }
        warm.close()?;
    }
    let clean = disk.state().durable.clone();
    let answers =
        |warm: &Warm| -> Result<Vec<Option<Hit>>, Error> { prompts.iter().map(|(m, p)| warm.warmest(m, p)).collect() };
    let expected = answers(&Warm::builder().open_with_backend(Disk::with_image(clean.clone()).backend())?)?;
    assert!(expected.iter().filter(|a| a.is_some()).count() > 30);
    let (mut refused, mut harmless, mut panics) = (0, 0, 0);
    let flips = 1000;
    for _ in 0..flips {
        let mut image = clean.clone();
        let bit = rng.below(image.len() as u64 * 8);
        image[(bit / 8) as usize] ^= 1 << (bit % 8);
        let outcome = catch_unwind(AssertUnwindSafe(|| -> Result<Vec<Option<Hit>>, Error> {
            let warm = Warm::builder().open_with_backend(Disk::with_image(image).backend())?;
            answers(&warm)
        }));
        match outcome {
            Err(_) => panics += 1,
            Ok(Err(_)) => refused += 1,
            Ok(Ok(got)) => {
                assert_eq!(got, expected, "a flip of bit {bit} was opened and answered differently");
                harmless += 1;
            }
        }
    }
    println!(
        "{flips} bit flips over a {} byte file: {refused} refused, {harmless} harmless, {panics} panics",
        clean.len()
    );
    assert_eq!(panics, 0);
    assert!(refused > 0, "flips in live pages are caught");
    Ok(())
}
