//! File requests, confined to the workspace.

use super::*;

pub(super) fn io_error(path: &Path, e: &std::io::Error) -> acp::Error {
    let code = if e.kind() == std::io::ErrorKind::NotFound {
        acp::ErrorCode::RESOURCE_NOT_FOUND
    } else {
        acp::ErrorCode::INTERNAL_ERROR
    };
    acp::Error::new(code, format!("{}: {e}", path.display()))
}

pub(super) fn file_error(
    path: &Path,
    e: crate::providers::workspace_files::FileError,
) -> acp::Error {
    match e {
        crate::providers::workspace_files::FileError::Refused(why) => acp::Error::new(
            acp::ErrorCode::INVALID_PARAMS,
            format!("{}: {why}", path.display()),
        ),
        crate::providers::workspace_files::FileError::Io(e) => io_error(path, &e),
    }
}

pub(super) async fn read_text_file(
    root: &Path,
    request: &proto::ReadTextFileRequest,
) -> Result<String, acp::Error> {
    let relative = crate::providers::workspace_files::relative_to(root, &request.path)
        .map_err(|e| file_error(&request.path, e))?;
    let text = crate::providers::workspace_files::read(root, &relative)
        .await
        .map_err(|e| file_error(&request.path, e))?;
    if request.line.is_none() && request.limit.is_none() {
        return Ok(text);
    }
    let skip = request
        .line
        .map_or(0, |line| line.saturating_sub(1) as usize);
    let take = request.limit.map_or(usize::MAX, |limit| limit as usize);
    Ok(text.split_inclusive('\n').skip(skip).take(take).collect())
}

/// Writes through [`crate::providers::workspace_files`]: no `.git` component, no symlink out of
/// the workspace, nothing written when refused.
pub(super) async fn write_text_file(
    root: &Path,
    request: &proto::WriteTextFileRequest,
) -> Result<(), acp::Error> {
    let relative = crate::providers::workspace_files::relative_to(root, &request.path)
        .map_err(|e| file_error(&request.path, e))?;
    crate::providers::workspace_files::write(root, &relative, request.content.as_bytes().to_vec())
        .await
        .map_err(|e| file_error(&request.path, e))
}
