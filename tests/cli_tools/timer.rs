//! `[training] max_time` through the CLI: Lightning's `max_time`.

use super::common::{config, digits_available, kiln_fails, losses, scratch, serial, train};
use kiln::train::{Checkpoint, Checkpointer};

/// A limit not reached trains as a run without one, and its checkpoints keep
/// the time trained, which a resumed run counts on from; a limit of zero
/// stops the run after its first step; a limit written wrong is refused
/// before training, naming the key and the form expected.
#[test]
fn max_time_stops_the_run_and_checkpoints_keep_the_time_trained() {
    let _serial = serial();
    if !digits_available() {
        return;
    }
    let dir = scratch("max-time");
    let plain = config(&dir, 0);
    let text = std::fs::read_to_string(&plain).unwrap();
    let with = |name: &str, value: &str| {
        let path = dir.join(name);
        std::fs::write(
            &path,
            text.replace("[training]\n", &format!("[training]\nmax_time = {value}\n")),
        )
        .unwrap();
        path.to_str().unwrap().to_owned()
    };
    let hour = with("hour.toml", "{ hours = 1 }");
    let (timed, untimed) = (dir.join("timed"), dir.join("untimed"));
    train(&hour, &timed, &["--epochs", "1"]);
    train(plain.to_str().unwrap(), &untimed, &["--epochs", "1"]);
    assert_eq!(
        losses(&timed),
        losses(&untimed),
        "a limit not reached changes nothing"
    );
    let elapsed = |run: &std::path::Path| {
        let last = Checkpointer::last_path(&run.join("checkpoints"));
        let checkpoint = Checkpoint::load(&last).unwrap();
        checkpoint.callbacks["Timer"]["time_elapsed"]
            .as_f64()
            .expect("the Timer's time in the checkpoint")
    };
    let first = elapsed(&timed);
    assert!(first.is_finite() && first >= 0.0, "{first}");
    train(&hour, &timed, &["--epochs", "2", "--resume", "auto"]);
    assert!(
        elapsed(&timed) >= first,
        "the resumed run counts the first run's time"
    );
    assert_eq!(losses(&timed).len(), 2 * losses(&untimed).len());

    let zero = with("zero.toml", "\"00:00:00:00\"");
    let stopped = dir.join("stopped");
    train(&zero, &stopped, &[]);
    assert_eq!(losses(&stopped).len(), 1, "stopped after its first step");
    assert_eq!(losses(&stopped)[0], losses(&untimed)[0]);

    let wrong = with("wrong.toml", "\"12:00:00\"");
    let err = kiln_fails(&[
        "train",
        "--config",
        &wrong,
        "--output",
        dir.join("x").to_str().unwrap(),
    ]);
    assert!(err.contains("training.max_time"), "{err}");
    assert!(
        err.contains("3 fields in \"12:00:00\"; expected \"DD:HH:MM:SS\""),
        "{err}"
    );
    assert!(
        !dir.join("x").exists(),
        "nothing written for a config refused"
    );
}
