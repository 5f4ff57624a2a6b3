//! The documentation as a reader meets it: README.md is the front door (short, and linking the
//! pages a newcomer looks for first), every relative link in it and in `docs/` leads to a file
//! and heading that exist, and no page sends its reader to what only the project's developers
//! have (issue numbers, the `../shared` folder beside a developer's checkout).

use std::path::{Path, PathBuf};

use crate::harness::repo_root;

/// README.md's size limit: the front door is read in minutes; the rest lives in `docs/`.
const README_MAX_BYTES: usize = 16_000;

/// A `docs/` page's size limit: a page a reader can take in at one sitting; what is longer
/// splits into pages of its own.
const PAGE_MAX_BYTES: usize = 25_000;

/// The pages README.md links within its first [`README_HEAD_LINES`] lines, so a newcomer finds
/// them without scrolling: joining a second box, fine-tuning a Hugging Face model, picking a
/// sync mode, watching a run, the threat model.
const README_HEAD_LINKS: [&str; 5] = [
    "docs/multi-box.md",
    "docs/huggingface.md",
    "docs/modes.md",
    "docs/cli.md#seeing-the-mesh",
    "docs/security.md",
];

/// How far down README.md the links of [`README_HEAD_LINKS`] must appear.
const README_HEAD_LINES: usize = 50;

/// README.md and every Markdown page under `docs/`.
fn pages() -> Vec<PathBuf> {
    let root = repo_root();
    let mut pages = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// The lines of `text` outside fenced code blocks, numbered from 1.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            lines.push((i + 1, line));
        }
    }
    lines
}

/// The targets of the Markdown links `[text](target)` on `line`.
fn link_targets(line: &str) -> Vec<&str> {
    let mut targets = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        targets.push(after[..end].trim());
        rest = &after[end..];
    }
    targets
}

/// GitHub's anchor for a heading: lower case, spaces to hyphens, punctuation but `-` and `_`
/// dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a page's headings.
fn anchors(text: &str) -> Vec<String> {
    prose_lines(text)
        .into_iter()
        .filter(|(_, l)| l.starts_with('#'))
        .map(|(_, l)| slug(l.trim_start_matches('#')))
        .collect()
}

/// Whether `line` names an issue by number (`issue 31`, `issues 29`, `issue #12`).
fn names_an_issue(line: &str) -> bool {
    let lower = line.to_lowercase();
    lower.match_indices("issue").any(|(at, _)| {
        let after = lower[at + "issue".len()..].trim_start_matches('s');
        let after = after.trim_start_matches([' ', '#']);
        after.starts_with(|c: char| c.is_ascii_digit())
    })
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn every_relative_link_in_readme_and_docs_leads_to_a_file_and_heading_that_exist() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = read(&page);
        for (n, line) in prose_lines(&text) {
            for target in link_targets(line) {
                if target.contains("://") || target.starts_with("mailto:") {
                    continue;
                }
                checked += 1;
                let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
                let linked = if file.is_empty() {
                    page.clone()
                } else {
                    page.parent().expect("a page's folder").join(file)
                };
                let at = format!("{}:{n}: {target}", page.display());
                if !linked.exists() {
                    broken.push(format!("{at}: no such file"));
                } else if !anchor.is_empty() && !anchors(&read(&linked)).contains(&anchor.into()) {
                    broken.push(format!("{at}: no heading with that anchor"));
                }
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} relative links found: the scan is broken"
    );
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn no_page_names_an_issue_number_or_the_developers_shared_folder() {
    let mut found = Vec::new();
    for page in pages() {
        let text = read(&page);
        for (n, line) in text.lines().enumerate() {
            if names_an_issue(line) || line.contains("../shared") {
                found.push(format!("{}:{}: {line}", page.display(), n + 1));
            }
        }
    }
    assert!(
        found.is_empty(),
        "pages that send a user to the developers' issues or folders:\n{}",
        found.join("\n")
    );
}

#[test]
fn readme_is_a_short_front_door_linking_what_newcomers_look_for_first() {
    let text = read(&repo_root().join("README.md"));
    assert!(
        text.len() <= README_MAX_BYTES,
        "README.md is {} bytes, over {README_MAX_BYTES}: move the detail into docs/",
        text.len()
    );
    let head: String = text
        .lines()
        .take(README_HEAD_LINES)
        .collect::<Vec<_>>()
        .join("\n");
    for page in README_HEAD_LINKS {
        assert!(
            head.contains(&format!("]({page})")) || head.contains(&format!("]({page}#")),
            "README.md does not link {page} in its first {README_HEAD_LINES} lines"
        );
    }
}

#[test]
fn no_docs_page_is_longer_than_a_reader_takes_in_at_once() {
    let long: Vec<String> = pages()
        .iter()
        .filter(|page| page.parent().is_some_and(|dir| dir.ends_with("docs")))
        .map(|page| (page, read(page).len()))
        .filter(|(_, len)| *len > PAGE_MAX_BYTES)
        .map(|(page, len)| format!("{}: {len} bytes", page.display()))
        .collect();
    assert!(
        long.is_empty(),
        "pages over {PAGE_MAX_BYTES} bytes (split them):\n{}",
        long.join("\n")
    );
}

#[test]
fn the_link_scan_reads_links_anchors_and_issue_numbers_as_meant() {
    assert_eq!(
        link_targets("see [a](docs/a.md#x) and [b](https://e.org) (c)"),
        ["docs/a.md#x", "https://e.org"]
    );
    assert_eq!(
        slug("Gossip's two mixing rules"),
        "gossips-two-mixing-rules"
    );
    assert_eq!(
        slug("The seeds' frameworks as sync modes"),
        "the-seeds-frameworks-as-sync-modes"
    );
    assert_eq!(
        anchors("# Top\n```\n# not a heading\n```\n## Seeing the mesh\n"),
        ["top", "seeing-the-mesh"]
    );
    assert!(names_an_issue(
        "the work against hostile members (issue 31: robust aggregation)"
    ));
    assert!(names_an_issue("Issues #12 and 13"));
    assert!(!names_an_issue("the issue notes hold the figures"));
    assert!(!names_an_issue("a known issue: 2 nodes"));
}
