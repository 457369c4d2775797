use dice_kernelbench::KernelBench;
use dice_test_support::test_data;
use std::fs;

#[test]
fn kernelbench_tree_has_all_problems_valid_and_sorted() {
    let kb = KernelBench::open(&test_data().join("kernelbench")).unwrap();
    assert_eq!(kb.levels().unwrap(), vec![1, 2, 3, 4]);
    for (level, count) in [(1, 100), (2, 100), (3, 50), (4, 20)] {
        let scan = kb.scan_level(level).unwrap();
        assert!(scan.invalid.is_empty(), "{:?}", scan.invalid);
        let ids: Vec<u32> = scan.problems.iter().map(|p| p.problem_id).collect();
        assert_eq!(ids, (1..=count).collect::<Vec<_>>());
        assert!(scan.problems.iter().all(|p| p.level == level));
        assert!(scan
            .problems
            .iter()
            .all(|p| p.needs_network() == (level == 4)));
    }
    assert_eq!(kb.scan(None).unwrap().problems.len(), 270);
}

#[test]
fn problem_bytes_are_untouched() {
    let kb = KernelBench::open(&test_data().join("kernelbench")).unwrap();
    let p = kb.problem(1, 12).unwrap();
    assert_eq!(p.name, "12_Matmul_with_diagonal_matrices_");
    assert_eq!(p.source, fs::read(&p.path).unwrap());
}

#[test]
fn missing_folder_is_one_clear_error() {
    let err = KernelBench::open("/no/such/kernelbench".as_ref()).unwrap_err();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("/no/such/kernelbench") && msg.contains("does not exist"),
        "{msg}"
    );
    assert!(!msg.contains('\n'));
}

#[test]
fn missing_level_names_the_levels_present() {
    let kb = KernelBench::open(&test_data().join("kernelbench")).unwrap();
    let msg = format!("{:#}", kb.scan_level(7).unwrap_err());
    assert!(
        msg.contains("level7") && msg.contains("1, 2, 3, 4"),
        "{msg}"
    );
}

const GOOD: &str = "import torch\nclass Model(torch.nn.Module):\n    pass\n\
def get_inputs():\n    return []\ndef get_init_inputs():\n    return []\n";

#[test]
fn invalid_files_are_reported_and_do_not_hide_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let level = dir.path().join("level1");
    fs::create_dir(&level).unwrap();
    fs::write(level.join("2_Good.py"), GOOD).unwrap();
    fs::write(level.join("10_Good.py"), GOOD).unwrap();
    fs::write(
        level.join("3_NoInputs.py"),
        "class Model:\n    pass\ndef get_init_inputs():\n    return []\n",
    )
    .unwrap();
    let mut latin1 = GOOD.as_bytes().to_vec();
    latin1.extend_from_slice(b"# caf\xe9\n");
    fs::write(level.join("4_Latin1.py"), latin1).unwrap();
    fs::write(level.join("2_Again.py"), GOOD).unwrap();
    fs::write(level.join("notes.py"), GOOD).unwrap();
    fs::write(level.join("README.md"), "not python").unwrap();

    let kb = KernelBench::open(dir.path()).unwrap();
    let scan = kb.scan_level(1).unwrap();
    let ids: Vec<u32> = scan.problems.iter().map(|p| p.problem_id).collect();
    assert_eq!(ids, vec![2, 10]);
    let reason = |name: &str| {
        scan.invalid
            .iter()
            .find(|i| i.path.ends_with(name))
            .map(|i| i.reason.clone())
            .unwrap_or_else(|| panic!("{name} not reported: {:?}", scan.invalid))
    };
    assert!(reason("3_NoInputs.py").contains("`def get_inputs`"));
    assert!(reason("4_Latin1.py").contains("UTF-8"));
    assert!(reason("2_Good.py").contains("already used by"));
    assert!(reason("notes.py").contains("ID_Name.py"));
    assert_eq!(scan.invalid.len(), 4);

    let msg = format!("{:#}", kb.problem(1, 3).unwrap_err());
    assert!(
        msg.contains("3_NoInputs.py") && msg.contains("get_inputs"),
        "{msg}"
    );
    let msg = format!("{:#}", kb.problem(1, 99).unwrap_err());
    assert!(msg.contains("no problem 99"), "{msg}");
}

#[test]
fn a_clone_root_is_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let level = dir.path().join("KernelBench").join("level2");
    fs::create_dir_all(&level).unwrap();
    fs::write(level.join("1_A.py"), GOOD).unwrap();
    let kb = KernelBench::open(dir.path()).unwrap();
    assert_eq!(kb.levels().unwrap(), vec![2]);
    assert_eq!(kb.problem(2, 1).unwrap().name, "1_A");
}
